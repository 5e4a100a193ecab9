"""A CPU cluster's physics (audit s54, finding 1): on a CPU a rank's memory IS the host's.

`meshtron train --nproc 2 --model <1.2B>` on a CPU planned on a nominal 4 GiB "device" and,
since nothing fit there, chose `offload=full`: FSDP2's CPU offload copying the states into the
same RAM, a plan that could fill a shared machine. Now the nominal CPU cluster gives each rank
its share of the machine's physical memory, and a CPU cluster (nominal, calibrated on a CPU, a
file's `cpu = true`) is never offered host offload."""

from __future__ import annotations

import json
import math
from pathlib import Path

from meshtron.planner.cluster import machine_memory_gib
from testkit.cli_inproc import meshtron_main

# Llama 3.2 1B's shapes (1.24B parameters, tied embeddings)
L1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
       "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
       "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 2048,
       "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
       "hidden_act": "silu"}
PLAN = ["--global-batch", "4", "--seq-len", "512", "--top", "2"]


def _config(folder: Path, **shapes) -> Path:
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps({**L1B, **shapes}))
    return path


def test_plan_on_nominal_cpu_gives_each_rank_its_share_and_never_offloads(tmp_path):
    """Before: '(2 x 0.05 TFLOP/s device, 4 GiB)' and offload='full' chosen because nothing
    fit. Now: the machine's memory over the ranks, and a plan without offload or a refusal."""
    model = _config(tmp_path / "l1b")
    rc, out, err = meshtron_main("plan", "--model", model, "--cluster", "nominal-cpu:2", *PLAN)
    share = round(machine_memory_gib() / 2, 2)
    assert f"on nominal-cpu:2 (2 x 0.05 TFLOP/s device, {share:g} GiB)" in " ".join(out.split())
    assert "offload" not in out + err, out + err
    assert rc in (0, 2), err  # a plan where the machine holds the states, else one line
    if rc == 2:
        assert "fits on no layout of nominal-cpu:2" in err and len(err.splitlines()) == 1


def test_the_cpu_flag_is_what_withholds_offload(tmp_path):
    """The same 4 GiB devices: as bare numbers (a GPU described by its figures) the search
    falls back to offload='full'; marked `cpu = true` it refuses in one line."""
    model = _config(tmp_path / "l1b")
    figures = ('peak_tflops = 0.05\nmemory_gib = 4\ngpus_per_node = 2\nnodes = 1\n'
               'intra_node_gb_per_s = 1\ninter_node_gb_per_s = 1\n')
    (tmp_path / "dev.toml").write_text(figures)
    (tmp_path / "cpu.toml").write_text(figures + "cpu = true\n")
    rc, out, err = meshtron_main("plan", "--model", model, "--cluster", tmp_path / "dev.toml",
                                 *PLAN)
    assert rc == 0 and "offload='full': chosen because no plan fits" in out, out + err
    rc, out, err = meshtron_main("plan", "--model", model, "--cluster", tmp_path / "cpu.toml",
                                 *PLAN)
    assert rc == 2 and "offload" not in out + err, out + err
    assert "fits on no layout of cpu" in err and len(err.splitlines()) == 1
    assert "GiB per CPU rank >" in err and "GPU" not in err, err


def test_a_cpu_plan_names_its_ranks_not_gpus():
    """Session-55 finding: a plan on nominal-cpu said 'memory of the fullest GPU' and 'host
    memory per GPU' about CPU ranks."""
    rc, out, err = meshtron_main("plan", "--model", "debug", "--cluster", "nominal-cpu:2")
    text = " ".join(out.split())
    assert rc == 0 and "memory of the fullest CPU rank (stage 0" in text, out + err
    assert "GiB of host memory per CPU rank" in text and "fullest GPU" not in text, out


def test_train_refuses_a_model_the_machine_cannot_hold_before_any_rank(tmp_path):
    """`train --nproc 2` with no cluster plans on the nominal CPU figures: a model whose
    weights, gradients and AdamW state (16 B a parameter) exceed this machine's memory is
    refused in one line before a run folder is written (before: offload='full', 2 ranks)."""
    per_layer = 4 * 1024**2 + 3 * 1024 * 4096  # attention and MLP weights, hidden 1024
    layers = math.ceil(machine_memory_gib() * 2**30 / 16 / per_layer) + 8
    model = _config(tmp_path / "huge", hidden_size=1024, intermediate_size=4096,
                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                    vocab_size=32000)
    run = tmp_path / "run"
    rc, out, err = meshtron_main("train", "--model", model, "--nproc", "2", "--steps", "1",
                                 "--global-batch", "4", "--seq-len", "64", "--run-dir", run)
    assert rc == 2, out + err
    assert "no plan fits 2 ranks of" in err and "offload" not in out + err, err
    assert len(err.strip().splitlines()) == 1 and not (run / "run.toml").exists()


def test_train_plans_a_cpu_node_on_its_memory_share_calibrated_or_not(tmp_path):
    """choose_cluster on a CPU node: the nominal figures with 1/N of the machine, marked cpu;
    a CPU calibration written before `cpu = true` existed is marked too."""
    from meshtron.calibrate.device import NodeDevice
    from meshtron.train.planning import choose_cluster

    cpu = NodeDevice("cpu", "cpu")
    nominal = choose_cluster(4, None, cpu, tmp_path / "absent.toml").cluster
    assert nominal.cpu and nominal.memory_gib == round(machine_memory_gib() / 4, 2)
    old = tmp_path / "local-4.toml"  # calibrate's keys, as an older version wrote them
    old.write_text('name = "local-4"\npeak_tflops = 0.08\nmemory_gib = 5.5\ngpus_per_node = 4\n'
                   'nodes = 1\nintra_node_gb_per_s = 2\ninter_node_gb_per_s = 2\n')
    old.with_suffix(".json").write_text(json.dumps({"device": "cpu", "device_name": "cpu",
                                                    "gpu": None}))
    calibrated = choose_cluster(4, None, cpu, old).cluster
    assert calibrated.name == "local-4" and calibrated.cpu and calibrated.memory_gib == 5.5


def test_the_machines_memory_is_its_control_groups_limit_where_lower(tmp_path):
    """Review s55: a container run with a memory limit (or a Slurm job's cgroup) saw the
    host's physical memory (os.sysconf), so nominal-cpu gave each rank a share the OOM killer
    never allows. The limit of the process's control group or of an ancestor binds: cgroup v2's
    memory.max and v1's memory.limit_in_bytes, read as the kernel writes them (files here)."""
    from meshtron.planner.cluster import nominal_cpu_cluster
    from meshtron.planner.machine_memory import (cgroup_limit_bytes, machine_memory_bytes,
                                                 physical_bytes)

    gib = 2**30
    proc, sysfs = tmp_path / "cgroup", tmp_path / "sys"
    proc.write_text("0::/user.slice/job_7\n")  # v2: the job's own limit
    (sysfs / "user.slice" / "job_7").mkdir(parents=True)
    (sysfs / "user.slice" / "job_7" / "memory.max").write_text(f"{2 * gib}\n")
    (sysfs / "user.slice" / "memory.max").write_text("max\n")
    assert cgroup_limit_bytes(proc, sysfs) == 2 * gib
    assert machine_memory_bytes(proc, sysfs) == min(physical_bytes(), 2 * gib)
    proc.write_text("5:cpu,cpuacct:/slurm/job_8\n4:memory:/slurm/job_8\n")  # v1, an ancestor
    v1 = sysfs / "memory" / "slurm"
    (v1 / "job_8").mkdir(parents=True)
    (v1 / "job_8" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # none
    (v1 / "memory.limit_in_bytes").write_text(f"{gib}\n")
    assert cgroup_limit_bytes(proc, sysfs) == gib
    share = machine_memory_bytes(proc, sysfs) / gib / 2
    assert share == min(physical_bytes() / gib, 1.0) / 2
    assert nominal_cpu_cluster(2, machine_memory_bytes(proc, sysfs) / gib).memory_gib == \
        round(share, 2)
    proc.write_text("0::/\n")  # no limit anywhere: the physical memory
    assert machine_memory_bytes(proc, tmp_path / "none") == physical_bytes()
    assert cgroup_limit_bytes(tmp_path / "absent", sysfs) is None  # not Linux
