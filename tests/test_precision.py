"""The run's precision: defaults per device, a saved plan's dtype honoured, contradictions
refused with one line (exit 2), and the one-process bf16 path's semantics (FSDP2's
MixedPrecisionPolicy: bf16 parameters and buffers, fp32 master gradients)."""

from __future__ import annotations

import pytest

from meshtron.cli import build_parser, main
from meshtron.errors import UserError
from meshtron.planner.plan import Plan
from meshtron.train.cli import run_config
from meshtron.calibrate.device import default_dtype


def _cfg(*argv):
    return run_config(build_parser().parse_args(["train", *argv]))


def _plan(tmp_path, **kw):
    path = tmp_path / "p.toml"
    Plan(model="debug", global_batch=8, seq_len=32, **kw).save(path)
    return str(path)


def test_default_dtype_per_device():
    assert default_dtype(cuda=True) == "bf16"
    assert default_dtype(cuda=False) == "fp32"
    # no flag, no run file, no plan: the device's default (this machine has no CUDA)
    assert _cfg("--model", "debug", "--seq-len", "32").train.dtype == default_dtype()


def test_saved_plan_dtype_is_honoured(tmp_path):
    path = _plan(tmp_path, dtype="bf16")
    assert _cfg("--plan", path).train.dtype == "bf16"
    assert _cfg("--plan", path, "--dtype", "bf16").train.dtype == "bf16"  # restating is fine
    with pytest.raises(UserError, match=r"train.dtype='fp32': the saved plan .* has "
                                        r"dtype=bf16"):
        _cfg("--plan", path, "--dtype", "fp32")


def test_plan_without_dtype_leaves_it_to_the_run(tmp_path):
    path = tmp_path / "old.toml"
    text = Plan(model="debug", global_batch=8, seq_len=32).to_toml()
    path.write_text("\n".join(line for line in text.splitlines()
                              if not line.startswith("dtype")))
    assert _cfg("--plan", str(path), "--dtype", "bf16").train.dtype == "bf16"


def test_contradicting_dtype_is_one_line_exit_2(tmp_path, capsys):
    path = _plan(tmp_path, dtype="bf16")
    rc = main(["train", "--plan", path, "--dtype", "fp32", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "dtype" in err, err
    assert not (tmp_path / "r").exists()


def test_plan_precision_fields_are_validated():
    assert Plan().reduce_dtype == "fp32" and Plan().accumulate_unsharded is False
    assert "reduce_dtype" not in Plan().to_toml()  # written only when not the default
    assert Plan.from_toml(Plan(reduce_dtype="bf16").to_toml()).reduce_dtype == "bf16"
    with pytest.raises(UserError, match=r"plan.reduce_dtype='fp16': allowed values are"):
        Plan(reduce_dtype="fp16")
    with pytest.raises(UserError, match=r"plan.accumulate_unsharded=1: must be true or false"):
        Plan(accumulate_unsharded=1)


def test_bf16_compute_is_fsdp2_mixed_precision():
    """bf16 parameters and buffers (the RoPE table too: FSDP2 casts each block's floating
    inputs), fp32 master gradients equal to the bf16 gradients."""
    import torch

    from meshtron.model import Transformer, preset
    from meshtron.model.transformer import cross_entropy_loss
    from meshtron.train.precision import BF16Compute

    torch.manual_seed(0)
    model = Transformer(preset("debug"))
    mp = BF16Compute(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)  # the master moved: refresh must carry it over
    mp.refresh()
    assert all(p.dtype == torch.bfloat16 for p in mp.model.parameters())
    assert mp.model.rope.dtype == torch.bfloat16
    for p, q in zip(model.parameters(), mp.model.parameters()):
        assert torch.equal(p.to(torch.bfloat16), q)
    x = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    cross_entropy_loss(mp.model(x), x).backward()
    want = [q.grad.float().clone() for q in mp.model.parameters()]
    mp.accumulate()
    assert all(q.grad is None for q in mp.model.parameters())
    for p, g in zip(model.parameters(), want):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, g)


@pytest.fixture
def _matmul_precision_restored():
    """The settings below are process-wide: back to torch's defaults afterwards (the new API
    "none", the legacy one "highest": the pair a fresh process has)."""
    import torch

    yield
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.fp32_precision = "none"
    assert torch.get_float32_matmul_precision() == "highest"


def test_fp32_on_cuda_turns_tf32_on_in_both_of_torchs_apis(_matmul_precision_restored):
    """An fp32 run on CUDA (the device injected: the setting needs no GPU) turns TF32 matmuls
    on so that torch's legacy getters agree with its new API. Set through the new API alone
    (`matmul.fp32_precision = "tf32"`), torch 2.11-2.13 raise "mix of the legacy and new
    APIs" from every later `torch.get_float32_matmul_precision()` and
    `torch.backends.cuda.matmul.allow_tf32` read: inductor's autotuning (max-autotune),
    TunableOp's float GEMMs and a Python-API user's own code read them."""
    import torch

    from meshtron.train.precision import configure_matmul_precision

    configure_matmul_precision(torch.device("cpu"), "fp32")  # the CPU: nothing set
    assert torch.backends.cuda.matmul.fp32_precision == "none"
    configure_matmul_precision(torch.device("cuda", 0), "bf16")  # bf16: nothing either
    assert torch.backends.cuda.matmul.fp32_precision == "none"
    configure_matmul_precision(torch.device("cuda", 0), "fp32")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"  # the CPU's matmuls untouched
