"""The olmo-core@2024 preset (planner/framework_presets.py) and the two loss terms it brought
(KernelOptions z_loss, logits_fp32; compute_edges.Z_LOSS_BYTES, FLASH_CE_FP32_BYTES): what
each moves per logit in the head, where it moves nothing, and the preset through `meshtron
plan` as a user types it (branch olmocore, session 43)."""

from __future__ import annotations

import json

import pytest

from meshtron.model import preset
from meshtron.planner.cluster import preset_cluster
from meshtron.planner.compute_edges import head_cost
from meshtron.planner.fp8 import fp8_gathers_fp8
from meshtron.planner.frameworks import PRESETS
from meshtron.planner.gemm import membound_bytes_per_s
from testkit.plan_cli import plan_cli  # noqa: F401 (fixture)

MB, SEQ = 2, 4096


def _head(**opts):
    model, cl = preset("llama3-8b"), preset_cluster("dgx-h100", 1)
    cost = head_cost(model, cl, 1, MB, SEQ, False, "eager", **opts)
    return cost, MB * SEQ * model.vocab, membound_bytes_per_s(cl, "eager")


def test_z_loss_apart_adds_its_logsumexp_passes():
    plain, logits, hbm = _head()
    with_z, _, _ = _head(z_loss=True)
    # ATen's logsumexp forward (amax 4, sub 8, exp_ 8, sum 4) and its backward with the add
    # into the cross-entropy's gradient (sub 8, exp 8, mul 8, accumulate 12)
    assert with_z.fwd - plain.fwd == pytest.approx(logits * 24 / hbm)
    assert with_z.compute - plain.compute == pytest.approx(logits * (24 + 36) / hbm)


def test_z_loss_inside_the_fused_kernel_costs_no_pass():
    fused, _, _ = _head(flash_ce=True)
    fused_z, _, _ = _head(flash_ce=True, z_loss=True)
    assert fused_z.compute == pytest.approx(fused.compute)


def test_fp32_logits_make_the_fused_loss_read_and_write_four_bytes():
    fused, logits, hbm = _head(flash_ce=True)
    fused32, _, _ = _head(flash_ce=True, logits_fp32=True)
    # forward: cast 2 + 4 and the kernel's 4-byte read instead of 2; backward: 4 + 4 in the
    # kernel and the gradient's cast back 4 + 2, instead of 2 + 2
    assert fused32.fwd - fused.fwd == pytest.approx(logits * (10 - 2) / hbm)
    assert fused32.compute - fused.compute == pytest.approx(logits * (10 + 14 - 2 - 4) / hbm)
    eager, _, _ = _head()
    eager32, _, _ = _head(logits_fp32=True)  # the eager loss casts to fp32 already
    assert eager32.compute == pytest.approx(eager.compute)


def test_only_olmo_core_states_the_z_loss_fp32_logits_and_fp8_gather():
    for name, fw in PRESETS.items():
        on = name == "olmo-core@2024"
        k = fw.kernel
        assert k.z_loss is on and k.logits_fp32 is on and k.fp8_fsdp_gather is on, name
    k = PRESETS["olmo-core@2024"].kernel
    assert (k.stack, k.optimizer, k.eager_norm, k.complex_rope, k.flash_ce) == \
        ("compiled", "fused", "python", False, False)


def _olmo_plan(plan_cli, tmp_path, options: str | None, micro_batch: int = 2,
               *extra: str) -> dict:
    """`meshtron plan --json`'s plan for Llama 3 8B on the olmo-core preset, data parallel
    ZeRO-3 on one DGX H100, with `options` as an [options] table."""
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100:1", "--global-batch", "256",
            "--seq-len", "4096", "--framework", "olmo-core@2024", "--layout",
            "tp=1,cp=1,pp=1,dp=8", "--zero", "3", "--recompute", "none", "--micro-batch",
            str(micro_batch), "--json", "--top", "1", *extra]
    if options:
        path = tmp_path / "options.toml"
        path.write_text(f"[options]\n{options}\n")
        args += ["--options", str(path)]
    rc, out, err = plan_cli(*args)
    assert rc == 0, err
    return json.loads(out)["plans"][0]


def _step(plan_cli, tmp_path, options: str | None) -> float:
    return _olmo_plan(plan_cli, tmp_path, options)["step_time_s"]


def test_cli_prices_the_z_loss_and_the_fused_loss(plan_cli, tmp_path):
    preset_step = _step(plan_cli, tmp_path, None)
    assert _step(plan_cli, tmp_path, "z_loss = false") < preset_step
    # the scripts' fused_loss: flash-attn's kernel, z-loss inside it, over fp32 logits
    fused = _step(plan_cli, tmp_path, 'flash_ce = true\nloss = "flash-ce"')
    assert fused < preset_step
    assert _step(plan_cli, tmp_path, 'flash_ce = true\nloss = "flash-ce"\nlogits_fp32 = false') \
        < fused


def test_fp8_fsdp_gather_turns_on_torchaos_gather_for_fixed_tensorwise_only():
    assert fp8_gathers_fp8("torchao-tensorwise", "rowwise", fsdp_gather=True)  # the recipe is
    assert not fp8_gathers_fp8("torchao-tensorwise", "rowwise")                # fixed: no plan's
    assert not fp8_gathers_fp8("torchao-tensorwise", "tensorwise", sharding="zero",
                               fsdp_gather=True)  # FSDP2's hook, not a distributed optimizer
    assert not fp8_gathers_fp8("torchao-rowwise", "tensorwise", fsdp_gather=True)
    assert not fp8_gathers_fp8("te-delayed", "tensorwise", fsdp_gather=True)


def test_cli_fp8_gather_shortens_the_fp8_step(plan_cli, tmp_path):
    def step(options: str) -> float:
        return _olmo_plan(plan_cli, tmp_path, options, 1, "--dtype", "fp8")["step_time_s"]

    assert step("fp8_fsdp_gather = true") < step("fp8_fsdp_gather = false")


def test_fp32_logits_and_the_z_loss_hold_their_bytes_at_the_loss():
    """Memory beside the time terms: flash-attn's kernel over fp32 logits keeps them and
    allocates their gradient like them (4 + 4 bytes per logit, not 2 + 2); a z-loss apart keeps
    logsumexp's saved input, the fp32 logits (4 more than the eager loss's 12)."""
    import dataclasses

    from meshtron.planner.memory import MemoryOptions, logits_bytes

    model = preset("llama3-8b")
    elements = MB * SEQ * model.vocab
    fused = MemoryOptions(framework="fsdp2", loss="flash-ce")
    assert logits_bytes(model, 1, MB, SEQ, fused) == elements * 4
    assert logits_bytes(model, 1, MB, SEQ, fused, logits_fp32=True) == elements * 8
    # inside the fused kernel the z-loss saves nothing of its own
    assert logits_bytes(model, 1, MB, SEQ, fused, z_loss=True, logits_fp32=True) == elements * 8
    eager = dataclasses.replace(fused, loss="eager")
    assert logits_bytes(model, 1, MB, SEQ, eager, logits_fp32=True) == elements * 12
    assert logits_bytes(model, 1, MB, SEQ, eager, z_loss=True, logits_fp32=True) == elements * 16


def test_cli_memory_counts_the_fused_losss_fp32_logits(plan_cli, tmp_path):
    """The 7B / 13B / Llama-8B scripts' fused loss over fp32 logits, through `meshtron plan`:
    the logits' share of the memory doubles against the same loss over 16-bit logits."""
    def logits_gib(extra: str) -> float:
        options = f'flash_ce = true\nloss = "flash-ce"\n{extra}'
        return _olmo_plan(plan_cli, tmp_path, options, 1)["memory_gib"]["logits"]

    bf16 = logits_gib("logits_fp32 = false")
    assert bf16 == pytest.approx(4096 * preset("llama3-8b").vocab * 4 / 2**30)
    assert logits_gib("") == pytest.approx(2 * bf16)
