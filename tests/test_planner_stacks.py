"""Planner v3: stacks (--framework / [options]), context parallelism, FP8 and TF32, what the
runtime runs (reduction timing and dtype, step_collectives), and the CLI edges of issue 23."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from meshtron.errors import UserError
from meshtron.model.spec import PRESETS
from meshtron.planner import Plan, resolve_cluster, search_plans, step_collectives
from meshtron.planner.estimate import Evaluator
from meshtron.planner.frameworks import PRESETS as STACKS
from meshtron.planner.frameworks import preset, resolve, with_options
from meshtron.planner.memory import embedding_params_local, head_params_local, layer_params_local
from testkit.plan_cli import commands_fixture


cli = commands_fixture("meshtron.planner.cli", "meshtron.cost.cli",
                       "meshtron.simulate.cli")


L8 = ("--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "64",
      "--seq-len", "8192")


def _eval(fw: str, plan: Plan, model="llama3-8b", cluster="dgx-h100:8", batch=512, seq=4096,
          **cl):
    f = preset(fw)
    c = dataclasses.replace(resolve_cluster(cluster), **cl) if cl else resolve_cluster(cluster)
    return Evaluator(PRESETS[model], c, batch, seq, f.kernel, mem=f.memory).evaluate(plan)


# ---- frameworks ----------------------------------------------------------------------------------
def test_every_preset_resolves_and_documents_itself():
    for key, fw in STACKS.items():
        assert preset(key) is fw and fw.models and fw.source
        assert fw.to_dict()["kernel"]["sharding"] in ("fsdp", "zero")
    assert preset(None).name == "meshtron" and preset("megatron").era == "2024"
    assert preset("nemo") is preset("megatron@2024") and preset("ptd-p").era == "2021"
    with pytest.raises(UserError, match="framework='titan'.*allowed"):
        preset("titan")


def test_options_override_single_fields_and_refuse_unknown(tmp_path):
    f = tmp_path / "o.toml"
    f.write_text('framework = "megatron@2024"\n[options]\ntp_comm_overlap = true\n'
                 'loss = "inplace"\nreduce_dtype = "bf16"\n')
    fw = resolve(None, f)
    assert fw.name == "megatron" and fw.kernel.tp_comm_overlap
    assert fw.memory.loss == "inplace" and fw.reduce_dtype == "bf16" and "+3" in fw.label
    with pytest.raises(UserError, match="contradicts"):
        resolve("deepspeed", f)
    f.write_text("[options]\nwarp_speed = 9\n")
    with pytest.raises(UserError, match=r"options\.warp_speed: unknown option"):
        resolve(None, f)
    with pytest.raises(UserError, match=r"options\.tp_comm_overlap=1: must be true or false"):
        with_options(preset("megatron"), {"tp_comm_overlap": 1})
    with pytest.raises(UserError, match="stack="):
        with_options(preset("megatron"), {"stack": "turbo"})


def test_tp_comm_overlap_hides_tensor_parallel_traffic():
    plan = Plan(tp=8, pp=1, dp=8, zero=1, micro_batch=1, sp=True, dtype="bf16")
    # Megatron-Core leaves TE userbuffers off (model_parallel_config.py); options turn them on
    assert not preset("megatron@2024").kernel.tp_comm_overlap
    off = _eval("megatron@2024", plan, model="llama3-70b")
    on = Evaluator(PRESETS["llama3-70b"], resolve_cluster("dgx-h100:8"), 512, 4096,
                   with_options(preset("megatron@2024"), {"tp_comm_overlap": True}).kernel,
                   mem=preset("megatron@2024").memory).evaluate(plan)
    # each collective hides behind its own GEMM only (compute.tp_exposed): most of a 70B
    # layer's traffic at tp 8, never all of it
    assert 0.15 * off.time.tp_comm < on.time.tp_comm < 0.6 * off.time.tp_comm


def test_megatron_reduces_once_per_step_whatever_the_micro_batches():
    """PTD-P all-reduces gradients once per step: 64 micro-batches cost the same reduction as 8."""
    plan = Plan(tp=8, pp=1, dp=8, zero=0, micro_batch=1, sp=True, dtype="bf16")
    few = _eval("megatron@2021", plan, batch=64, inter_node_gb_per_s=5.0)
    many = _eval("megatron@2021", plan, batch=512, inter_node_gb_per_s=5.0)
    assert few.time.dp_comm == pytest.approx(many.time.dp_comm, rel=1e-9)
    # the 2021 tree adds each micro-batch's bf16 gradient to the fp32 main_grad in a pass of
    # its own (gradient accumulation fusion came in 2022): 2 + 4 + 4 bytes per tp-local
    # parameter (about 1e9 of llama3-8b at tp 8) and micro-batch after the first, whose cast
    # moves 2 + 4 (streaming; the adds across dtypes at compute.cast_add_bytes_per_s, 2.52 TB/s
    # on an H100); the rest of the compute is 8x
    adds, casts = (63 - 8 * 7) * 10.0, (1 - 8) * 6.0
    extra = 1.004e9 * (adds / 2.52e12 + casts / (3350e9 * 0.8))
    assert many.time.compute - 8 * few.time.compute == pytest.approx(extra, rel=0.01)


def test_plan_states_the_stack_in_table_and_json(cli):
    rc, out, _ = cli("plan", *L8, "--framework", "megatron@2021", "--top", "1")
    assert rc == 0 and "Stack: megatron@2021" in out
    rc, out, _ = cli("plan", *L8, "--framework", "torchtitan", "--json", "--top", "1")
    doc = json.loads(out)
    assert rc == 0 and doc["framework"]["name"] == "torchtitan"
    assert doc["framework"]["memory"]["activations"] == "alternate-matmul"


# ---- context parallelism, dtypes ----------------------------------------------------------------
def test_cp_in_layout_splits_tokens_and_prices_kv_exchange(cli):
    base = Plan(tp=4, pp=1, dp=2, zero=1, micro_batch=1, sp=True, dtype="bf16")
    one = _eval("megatron@2024", base, batch=64, seq=32768)
    two = _eval("megatron@2024", base.replace(cp=2, dp=1), batch=32, seq=32768)
    # same tokens per rank per micro-batch halves: activations and per-micro-batch compute drop
    assert two.memory.activations == pytest.approx(one.memory.activations / 2, rel=0.05)
    assert two.time.tp_comm > 0
    rc, out, _ = cli("plan", "--model", "llama3-8b", "--cluster", "dgx-h100:1",
                     "--global-batch", "4", "--seq-len", "8192", "--layout",
                     "tp=4,cp=2,dp=1", "--json", "--top", "1")
    assert rc == 0
    best = json.loads(out)["plans"][0]
    assert best["cp"] == 2 and best["tp"] == 4 and best["dp"] == 1
    with pytest.raises(UserError, match=r"plan\.cp=3: seq_len=4096 must be divisible by 2\*cp"):
        Plan(cp=3, seq_len=4096)
    with pytest.raises(UserError, match=r"tp\*cp\*pp=1\*2\*2\*1=4: must equal the world size 2"):
        Plan(dp=1, cp=2, tp=2).validate(2)
    # cp runs now on FSDP ZeRO-2/3 without a pipeline; the rest is refused with one line
    Plan(dp=1, cp=2, tp=2, zero=2).validate(4)
    with pytest.raises(UserError, match="plan.cp=2 with plan.pp=2: meshtron's runtime"):
        Plan(dp=1, cp=2, pp=2, zero=2).validate(4)
    Plan(dp=2, dtype="fp8").validate(2)  # torchao float8 (emulated on CPU)
    with pytest.raises(UserError, match="plan.dtype='fp8' with tp=2: meshtron's runtime"):
        Plan(tp=2, dtype="fp8").validate(2)


def test_search_tries_cp_on_long_sequences():
    r = search_plans(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:1"), 8, 65536,
                     {"dtype": "bf16"}, top_k=20, explain=False, framework=preset("torchtitan"))
    assert any(e.config.cp > 1 for e in r.plans)
    assert all(e.config.gpus == 8 for e in r.plans)
    # meshtron's own runtime runs cp with FSDP ZeRO-2/3 and no pipeline: its search tries
    # exactly those (plan_rules.cp_runtime_problems)
    r = search_plans(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:1"), 8, 65536,
                     {"dtype": "bf16"}, top_k=20, explain=False)
    assert r.plans and any(e.config.cp > 1 for e in r.plans)
    assert all(e.config.pp == 1 and e.config.zero >= 2 for e in r.plans if e.config.cp > 1)


def test_fp8_uses_the_fp8_peak_for_block_gemms_and_tf32_for_fp32():
    plan = Plan(tp=1, pp=1, dp=8, zero=3, micro_batch=1, dtype="bf16")
    f = preset("megatron@2024")
    ev = Evaluator(PRESETS["llama3-8b"], resolve_cluster("dgx-h100:8"), 512, 4096, f.kernel,
                   mem=f.memory)

    def work(dtype):  # the micro-batches' compute, without the accumulation of the reduced
        p = plan.replace(dtype=dtype)  # fp32 gradient shards (the same in every dtype)
        est = ev.evaluate(p)
        m = est.num_microbatches
        return est.time.compute - ev.accumulation_s(p, 32, 0, m, ev.dp_flags(p))
    bf16, fp8, fp32 = work("bf16"), work("fp8"), work("fp32")
    # block GEMMs at 2x peak, head and attention core stay bf16, casts cost HBM traffic
    assert 0.5 * bf16 < fp8 < 0.85 * bf16
    assert fp32 > 1.7 * bf16  # TF32: half the bf16 peak on H100
    with pytest.raises(UserError, match="A100-SXM4-80GB has no FP8"):
        _eval("megatron@2024", plan.replace(dtype="fp8"), cluster="dgx-a100:8")


def test_reduce_dtype_is_on_the_wire():
    cl = {"inter_node_gb_per_s": 5.0}
    plan = Plan(tp=1, pp=1, dp=64, zero=0, micro_batch=1, dtype="bf16")
    fp32 = _eval("meshtron", plan, **cl).time.dp_comm
    bf16 = _eval("meshtron", plan.replace(reduce_dtype="bf16"), **cl).time.dp_comm
    assert bf16 < 0.6 * fp32


def test_plan_file_round_trip_of_shared_fields(tmp_path):
    p = Plan(tp=2, cp=2, pp=1, dp=2, zero=3, reduce_dtype="bf16", accumulate_unsharded=True,
             dtype="fp8")
    text = p.to_toml()
    assert "cp = 2" in text and 'reduce_dtype = "bf16"' in text and "gpus = 8" in text
    assert Plan.from_toml(text) == p
    assert "cp =" not in Plan().to_toml() and "reduce_dtype" not in Plan().to_toml()
    with pytest.raises(UserError, match="plan.reduce_dtype='fp16'"):
        Plan(reduce_dtype="fp16")
    with pytest.raises(UserError, match="accumulate_unsharded=true with plan.zero=1"):
        Plan(dp=2, zero=1, accumulate_unsharded=True)


# ---- what the runtime runs -----------------------------------------------------------------------
def test_step_collectives_count_what_meshtron_runs():
    model = PRESETS["debug"]  # 2 layers
    emb, blk = embedding_params_local(model, 1), layer_params_local(model, 1)
    head = head_params_local(model, 1, 1)
    units = sorted([emb, blk, blk, head])

    def rows(plan, batch=8, **kw):
        return [(c.kind, c.axis, c.count, c.bytes) for c in step_collectives(plan, model, batch,
                                                                            64, **kw)]
    # ZeRO-0: one fp32 all-reduce per unit per step, whatever the 4 micro-batches
    r = rows(Plan(dp=2, zero=0, micro_batch=1))
    assert sum(c for k, _, c, _ in r if k == "all_reduce") == 4
    assert sorted(b for k, _, c, b in r for _ in range(c)) == sorted(4 * u for u in units)
    # ZeRO-1: a distributed optimizer: reduce-scatter + fp32 all-gather of the shard, per unit
    r = rows(Plan(dp=2, zero=1, reduce_dtype="bf16"))
    assert {k for k, *_ in r} == {"reduce_scatter", "all_gather"}
    assert sum(c for k, _, c, _ in r if k == "reduce_scatter") == 4
    assert sum(b * c for k, _, c, b in r if k == "reduce_scatter") == sum(2 * u for u in units)
    assert sum(b * c for k, _, c, b in r if k == "all_gather") == sum(4 * u / 2 for u in units)
    # ZeRO-3, 4 micro-batches: gathers before forward (4 units) and backward (3: not the head)
    r = rows(Plan(dp=2, zero=3, micro_batch=1, dtype="bf16"))
    assert sum(c for k, _, c, _ in r if k == "all_gather") == 4 * 4 + 4 * 3
    assert sum(c for k, _, c, _ in r if k == "reduce_scatter") == 4 * 4
    r = rows(Plan(dp=2, zero=3, micro_batch=1, dtype="bf16", accumulate_unsharded=True))
    assert sum(c for k, _, c, _ in r if k == "reduce_scatter") == 4
    # HSDP: an all-reduce of the shard over the replicas after each reduce-scatter
    r = rows(Plan(dp=4, dp_replicate=2, zero=2, micro_batch=1), batch=8)
    assert sum(c for k, a, c, _ in r if k == "all_reduce" and a == "dp_replicate") == 2 * 4
    # pipelining: gathered and reduced once per step; 2 micro-batches cross the boundary
    plan = Plan(dp=2, pp=2, zero=3, micro_batch=2, dtype="bf16")
    act = 2 * 2 * 64 * model.hidden  # bf16 [micro_batch, seq, hidden]
    for rank in (0, 1):
        r = rows(plan, pp_rank=rank)
        assert sum(c for k, _, c, _ in r if k == "all_gather") == 2  # 2 units, once each
        assert sum(c for k, _, c, _ in r if k == "reduce_scatter") == 2
        assert sorted((k, c, b) for k, a, c, b in r if a == "pp") == [("recv", 2, act),
                                                                      ("send", 2, act)]
    with pytest.raises(UserError, match="grad_compression"):
        step_collectives(Plan(dp=2, grad_compression="int8"), model, 8, 64)


@pytest.mark.parametrize("kw", [
    dict(zero=0), dict(zero=1), dict(zero=1, dtype="bf16"), dict(zero=2, reduce_dtype="bf16"),
    dict(zero=3, dtype="bf16"), dict(zero=3, accumulate_unsharded=True),
    dict(zero=2, dp_replicate=2, dtype="bf16")])
def test_time_model_prices_the_counted_collectives(kw):
    """The cost model's dp inputs (dp_flags, fsdp_units) describe step_collectives' list, the one
    tests/test_dp_collectives.py counts on gloo: calls per step, bytes per element on the wire,
    total bytes (one stage, 4 micro-batches)."""
    model = PRESETS["debug"]
    ev = Evaluator(model, resolve_cluster("dgx-h100:8"), 16, 64)
    plan = Plan(dp=4, micro_batch=1, **kw)
    flags = ev.dp_flags(plan)
    units = ev.fsdp_units(model.layers, True, True)
    m = 4
    p_layer, p_emb, p_head, _ = ev._params(1, 1)
    params = model.layers * p_layer + p_emb + p_head
    listed = step_collectives(plan, model, 16, 64)
    red = [c for c in listed if c.kind in ("reduce_scatter", "all_reduce")
           and c.axis == ("dp_shard" if plan.zero >= 2 else "dp_replicate")]
    gat = [c for c in listed if c.kind == "all_gather"]
    n_red = units * (1 if plan.zero <= 1 or flags["reduce_once"] else m)
    n_gat = 0 if plan.zero == 0 else units * (1 if plan.zero == 1 or flags["gather_once"] else m)
    if plan.zero == 3 and not flags["gather_once"]:
        n_gat += (units - 1) * m  # the backward re-gathers all but the kept [norm, head]
    assert sum(c.count for c in red) == n_red
    assert sum(c.count for c in gat) == n_gat
    width = {"fp32": 4.0, "bf16": 2.0}
    assert {width[c.dtype] for c in red} == {flags["gsize"]}
    assert {width[c.dtype] for c in gat} <= {flags["wsize"]}
    per_round = n_red // units
    assert sum(c.count * c.bytes for c in red) == pytest.approx(
        per_round * flags["gsize"] * params, rel=1e-9)
    # gathered per step: every unit per round, the backward's rounds without the kept head
    shard = plan.dp if plan.zero <= 1 else plan.dp_shard
    rounds = n_gat // units if plan.zero < 3 or flags["gather_once"] else m
    back = m if plan.zero == 3 and not flags["gather_once"] else 0
    assert sum(c.count * c.bytes for c in gat) == pytest.approx(
        flags["wsize"] * (rounds * params + back * (params - p_head)) / shard, rel=1e-3)


# ---- CLI edges (issue 23) -------------------------------------------------------------------------
def test_plan_json_into_head_ends_quietly():
    cmd = (f"{sys.executable} -m meshtron plan --model llama3-8b --cluster dgx-h100:1 "
           "--global-batch 64 --seq-len 4096 --json | head -1")
    out = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout == "{\n" and "Traceback" not in out.stderr
    assert "BrokenPipe" not in out.stderr and out.returncode == 0


def test_nothing_fits_is_said_once(cli):
    # pp=8 on 16 GPUs: meshtron's host offload (FSDP2) does not run in a pipeline, so nothing
    # fits; tp and dp are left to the search (a pinned layout would be priced,
    # tests/test_plan_pinned.py)
    rc, out, err = cli("plan", "--model", "llama3-405b", "--cluster", "dgx-h100:2",
                       "--global-batch", "64", "--seq-len", "8192", "--layout", "pp=8")
    assert rc == 2 and (out + err).count("Nothing fits") == 1
    assert err.count("fits on no layout") == 1 and err.count("\n") == 1
    assert "PREDICTED NOT TO FIT" not in out + err


def test_selective_is_searched_where_it_saves_memory(cli):
    rc, out, _ = cli("plan", *L8, "--layout", "dp=8", "--zero", "3", "--micro-batch", "2",
                     "--json")
    doc = json.loads(out)
    assert rc == 0 and not any("selective left out" in n for n in doc["notes"])
    # the chosen plan or an alternative (since the chunked loss left the logits out, issue 30,
    # selective fits here and is the best plan)
    sel = ([{**p, "memory_gib": p["memory_gib"]["total"]} for p in doc["plans"]
            if p["recompute"] == "selective"]
           + [a for a in doc["alternatives"] if "recompute=selective" in a["family"]])
    none = [a for a in doc["alternatives"] if "recompute=none" in a["family"]]
    assert sel and none  # issue 23: 98.3 GiB against 142.6 GiB
    assert sel[0]["memory_gib"] < none[0]["memory_gib"] - 20


def test_layer_count_limit_is_not_worded_as_memory(cli):
    rc, _, err = cli("plan", "--model", "debug", "--cluster", "dgx-h100:1", "--global-batch",
                     "8", "--seq-len", "64", "--layout", "tp=2,pp=2,dp=2",
                     "--schedule", "interleaved")
    assert rc == 2 and "layers" in err and "GiB" not in err


def test_mistral_sliding_window_priced_at_the_window_to_its_positions(cli, tmp_path):
    """Mistral-7B-v0.1's 4096-token window in every block: sequences run to its 32768
    positions without a warning (the runtime computes the window), the attention core priced
    at the window (a step at 16k tokens is cheaper than the same model without a window)."""
    cfg = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}
    times = {}
    for window in (4096, None):
        path = tmp_path / str(window) / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(dict(cfg, sliding_window=window)))
        args = ("plan", "--model", str(path), "--cluster", "dgx-h100:1", "--global-batch",
                "64", "--top", "1", "--layout", "tp=8,pp=1,dp=1", "--seq-len", "16384")
        rc, out, _ = cli(*args)
        assert rc == 0 and "max_seq" not in " ".join(out.split())
        rc, out, _ = cli(*args, "--json")
        times[window] = json.loads(out)["plans"][0]["step_time_s"]
    assert times[4096] < 0.95 * times[None], times


def test_simulate_refuses_a_range_it_would_not_sweep(cli, tmp_path):
    rc, _, err = cli("simulate", "--model", "llama3-8b", "--global-batch", "64", "--seq-len",
                     "4096", "--gpus", "100..300", "--out", str(tmp_path / "s"))
    assert rc == 2 and "100 and 300 are not" in err and not (tmp_path / "s").exists()


def test_cost_reads_model_and_cluster_from_the_plan(cli, tmp_path):
    plan = tmp_path / "p.toml"
    assert cli("plan", *L8, "--save", str(plan), "--top", "1")[0] == 0
    rc, out, err = cli("cost", "--plan", str(plan), "--json", "--runs", "200")
    assert rc == 0 and json.loads(out)["gpus"] == 8
    rc, _, err = cli("cost", "--plan", str(plan), "--model", "llama3-70b")
    assert rc == 2 and "contradicts" in err and err.count("\n") == 1
    rc, _, err = cli("cost", "--plan", str(plan), "--runs", "100000000")
    assert rc == 2 and "runs=100000000" in err
    rc, _, err = cli("cost", "--plan", str(plan), "--gpu-watts", "0")
    assert rc == 2 and "gpu-watts" in err
    rc, out, err = cli("cost", "--plan", str(plan), "--deadline-days", "0.5", "--runs", "200",
                       "--json")
    assert rc == 0 and "no option meets it" in err and json.loads(out)["warnings"]


def test_sustained_clock_in_a_cluster_file_scales_the_gemms(cli, tmp_path):
    """A power-capped or clock-locked cluster (issue 30): `sustained_clock_mhz` scales the
    large GEMMs by clock / boost in place of the catalogue's 0.93 under-load factor; the same
    clock as that factor gives the catalogue's plan, a lower one a compute time longer by the
    ratio, one above the boost clock a one-line error."""
    def plan(clock):
        path = tmp_path / f"c{clock}.toml"
        extra = f"sustained_clock_mhz = {clock}\n" if clock else ""
        path.write_text('gpu = "H100"\ngpus_per_node = 8\nnodes = 1\n'
                        'intra_node_gb_per_s = 450\ninter_node_gb_per_s = 50\n' + extra)
        return cli("plan", "--model", "llama3-8b", "--cluster", str(path), "--global-batch",
                   "64", "--seq-len", "4096", "--layout", "dp=8", "--zero", "3",
                   "--micro-batch", "1", "--recompute", "none", "--top", "1", "--json")
    rc0, out0, _ = plan(None)
    rc1, out1, _ = plan(round(1980 * 0.93, 3))
    rc2, out2, _ = plan(1386)  # 0.7 of boost
    assert rc0 == rc1 == rc2 == 0
    t0, t1, t2 = (json.loads(o)["plans"][0]["time_s"]["compute"] for o in (out0, out1, out2))
    assert t1 == pytest.approx(t0, rel=1e-9)
    assert 1.0 < t2 / t0 <= 0.93 / 0.7 + 1e-9  # GEMMs slower by the clock; memory-bound ops not
    rc, _, err = plan(2500)
    assert rc == 2 and "sustained_clock_mhz=2500" in err and "boost" in err


def test_torch_pipelining_stacks_search_only_micro_batch_counts_their_schedules_run():
    """torchtitan runs torch.distributed.pipelining's schedules, whose looped orders need the
    micro-batches in whole rounds (plan_rules_pipeline.microbatch_problem): the search priced
    DeepSeek-V3 at pp 16, v 2 and 120 micro-batches, whose order deadlocks (a RuntimeError
    traceback from `meshtron plan ... --framework torchtitan@2025`). Every plan it keeps now
    passes the rule."""
    from meshtron.planner.plan_rules_pipeline import microbatch_problem

    r = search_plans(PRESETS["deepseek-v3"], resolve_cluster("dgx-h100:256"), 15360, 4096,
                     {"dtype": "bf16"}, top_k=5, explain=True, framework=preset("torchtitan"))
    assert r.plans
    for e in r.plans:
        c = e.config
        m = 15360 // (c.dp * c.micro_batch)
        assert microbatch_problem(c.schedule, c.pp, c.virtual_stages or 1, m) is None, c
