"""ModelSpec presets, exact parameter counts, HF config.json reading, and the plain model."""

import json

import pytest
import torch

from meshtron.model import PRESETS, Transformer, from_hf_config, resolve_model
from meshtron.model.spec import ModelSpec

KNOWN_TOTALS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name,total", KNOWN_TOTALS.items())
def test_parameter_counts_match_published_totals(name, total):
    assert PRESETS[name].num_params() == total


def test_gpt3_175b_is_175b():
    assert abs(PRESETS["gpt3-175b"].num_params() / 1e9 - 174.6) < 0.1


@pytest.mark.parametrize("name", ["tiny", "debug", "tiny-gpt"])
def test_module_parameter_count_equals_spec(name):
    spec = PRESETS[name]
    model = Transformer(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params()


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


LLAMA_CFG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
             "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_hf_llama_config(tmp_path):
    spec = from_hf_config(_write(tmp_path, LLAMA_CFG))
    assert spec.num_params() == 8_030_261_248
    assert spec.kv_heads == 8 and spec.rope_theta == 500000.0


def test_a_hub_cache_snapshot_is_named_after_its_repository(tmp_path, capsys):
    """`meshtron plan --model` on a folder of Hugging Face's hub cache
    (models--ORG--NAME/snapshots/REVISION) names the model NAME, not the revision's hash;
    any other folder keeps its own name."""
    from meshtron.cli import main

    revision = "0e9e39f249a16976918f6564b8830bc894c89659"
    snapshot = tmp_path / "models--meta-llama--Llama-3.1-8B" / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_CFG))
    assert main(["plan", "--model", str(snapshot), "--cluster", "dgx-h100:1",
                 "--global-batch", "64", "--seq-len", "4096"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("Llama-3.1-8B (8.03B params)") and revision not in header, header
    plain = tmp_path / "my-llama"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(LLAMA_CFG))
    assert resolve_model(str(plain)).name == "my-llama"
    # a config file of another name is named after itself, not its folder (audit s54: two
    # files of one folder were one name in every table, run folder and plan.toml)
    (plain / "llama-8k.json").write_text(json.dumps(LLAMA_CFG))
    assert resolve_model(str(plain / "llama-8k.json")).name == "llama-8k"
    assert resolve_model(str(plain / "config.json")).name == "my-llama"


def test_hf_gpt2_config_matches_gpt2_small(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
           "vocab_size": 50257, "n_positions": 1024}
    assert from_hf_config(_write(tmp_path, cfg)).num_params() == 124_439_808


def test_hf_gpt_neox_config_matches_pythia_160m(tmp_path):
    cfg = {"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072,
           "num_attention_heads": 12, "num_hidden_layers": 12, "vocab_size": 50304,
           "max_position_embeddings": 2048, "rotary_pct": 1.0, "tie_word_embeddings": False,
           "use_parallel_residual": True}
    spec = from_hf_config(_write(tmp_path, cfg))
    # Pythia-160m's published count (HF num_parameters) is 162,322,944.
    assert spec.num_params() == 162_322_944
    assert spec.parallel_residual


def test_hf_qwen2_and_mistral(tmp_path):
    qwen = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
            "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768}
    # Qwen2-0.5B: 494,032,768 parameters.
    assert from_hf_config(_write(tmp_path, qwen)).num_params() == 494_032_768
    mistral = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
               "vocab_size": 32000}
    # Mistral-7B-v0.1: 7,241,732,096 parameters.
    assert from_hf_config(_write(tmp_path, mistral)).num_params() == 7_241_732_096


@pytest.mark.parametrize("cfg,needle", [
    ({"model_type": "bert"}, "model_type='bert'"),
    ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 1,
      "intermediate_size": 8, "vocab_size": 10}, "heads=5"),
])
def test_hf_config_errors_name_the_field(tmp_path, cfg, needle):
    with pytest.raises(ValueError, match=needle):
        from_hf_config(_write(tmp_path, cfg))


def test_malformed_json_and_unknown_preset(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(bad))
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_model("llama9-1t")


def test_spec_validation():
    with pytest.raises(ValueError, match="kv_heads=3"):
        ModelSpec(name="x", layers=1, hidden=64, heads=4, kv_heads=3, ffn_hidden=8, vocab=10, max_seq=8)
    with pytest.raises(ValueError, match="layers=0"):
        ModelSpec(name="x", layers=0, hidden=64, heads=4, kv_heads=2, ffn_hidden=8, vocab=10, max_seq=8)


@pytest.mark.parametrize("name", ["debug", "tiny-gpt"])
def test_model_is_causal_and_deterministic(name):
    spec = PRESETS[name].replace(layers=2)
    torch.manual_seed(0)
    a = Transformer(spec)
    torch.manual_seed(0)
    b = Transformer(spec)
    x = torch.randint(0, spec.vocab, (2, 12))
    out = a(x)
    assert torch.equal(out, b(x))
    # Changing a future token must not change earlier logits.
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % spec.vocab
    assert torch.allclose(a(y)[:, :-1], out[:, :-1], atol=1e-6)
    assert not torch.allclose(a(y)[:, -1], out[:, -1])


def test_gqa_equals_explicit_repeated_heads():
    """GQA with kv_heads=2 equals MHA whose k/v projections repeat each kv head's rows."""
    spec = PRESETS["debug"]  # heads 4, kv_heads 2
    torch.manual_seed(0)
    gqa = Transformer(spec)
    mha = Transformer(spec.replace(kv_heads=spec.heads))
    sd = gqa.state_dict()
    hd = spec.head_dim
    for key in list(sd):
        if key.endswith(("wk.weight", "wv.weight")):
            w = sd[key].view(spec.kv_heads, hd, spec.hidden)
            sd[key] = w.repeat_interleave(spec.heads // spec.kv_heads, dim=0).reshape(-1, spec.hidden)
    mha.load_state_dict(sd)
    x = torch.randint(0, spec.vocab, (2, 10))
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


def test_gqa_passes_kv_heads_to_the_kernel_uncopied():
    """Native GQA: SDPA receives the kv_heads key/value heads; nothing repeats them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    spec = PRESETS["debug"].replace(layers=1)  # heads 4, kv_heads 2
    model = Transformer(spec, init_seed=0)
    seen: list = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func) and "backward" not in str(func):
                seen.append(("sdpa", args[0].shape[1], args[1].shape[1]))
            elif "repeat" in str(func):
                seen.append(("repeat",))
            return func(*args, **(kwargs or {}))

    with Ops():
        model(torch.randint(0, spec.vocab, (2, 10))).sum().backward()
    assert seen == [("sdpa", spec.heads, spec.kv_heads)]


def _loss_and_grads(model, x, y, chunked: bool, dtype=None):
    from meshtron.model import cross_entropy_loss

    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(x, y) if chunked else cross_entropy_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,ignored", [("debug", False), ("tiny-gpt", False),
                                          ("debug", True)])
def test_chunked_cross_entropy_equals_plain_loss_and_gradients(name, ignored):
    """model(x, targets): the fused head + loss (gradients computed chunk by chunk in the
    forward, weight gradient summed in fp32) equals the whole-logits fp32 loss (loss and every
    gradient, tied embeddings included), in fp32 and under bf16 autocast, with ignored
    targets (IGNORE_INDEX rows left out of the mean) as well."""
    spec = PRESETS[name].replace(layers=1)
    model = Transformer(spec, init_seed=3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec.vocab, (3, 17), generator=g)  # 51 tokens: uneven chunks
    y = torch.randint(0, spec.vocab, (3, 17), generator=g)
    if ignored:
        y[0, :6] = -100  # prompt-like prefix and padding at the end
        y[2, -4:] = -100
    ref_loss, ref_grads = _loss_and_grads(model, x, y, chunked=False)
    loss, grads = _loss_and_grads(model, x, y, chunked=True)
    assert abs(float(loss - ref_loss)) < 1e-6 * float(ref_loss)
    for n, gr in ref_grads.items():
        assert (grads[n] - gr).abs().max() <= 1e-5 * gr.abs().max() + 1e-9, n
    # bf16 autocast: bf16 logits per chunk with fp32 math inside, as the plain loss computes.
    ref_loss, ref_grads = _loss_and_grads(model, x, y, chunked=False, dtype=torch.bfloat16)
    loss, grads = _loss_and_grads(model, x, y, chunked=True, dtype=torch.bfloat16)
    assert abs(float(loss - ref_loss)) < 1e-3 * float(ref_loss)
    for n, gr in ref_grads.items():
        assert (grads[n] - gr).abs().max() <= 2e-2 * gr.abs().max() + 1e-6, n


def test_chunked_cross_entropy_chunks_and_ignore_index():
    """Any chunk size gives the same loss; ignored targets leave the mean as F.cross_entropy
    does; the whole [tokens, vocab] logits never exist (largest float tensor is one chunk's)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshtron.model.loss import chunked_cross_entropy

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    h = torch.randn(2, 40, 16, requires_grad=True)
    t = torch.randint(0, 300, (2, 40))
    t[0, :7] = -100
    want = F.cross_entropy(head(h).flatten(0, 1), t.flatten())
    want_grad = torch.autograd.grad(want, (h, head.weight))
    largest = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                largest.append(out.numel())
            return out

    for chunk in (1, 7, 80, 1000):
        largest.clear()
        with Sizes():
            got = chunked_cross_entropy(head, h, t, chunk=chunk)
            got_grad = torch.autograd.grad(got, (h, head.weight))
        assert abs(float(got.detach() - want.detach())) < 1e-6
        for a, b in zip(got_grad, want_grad):
            assert (a - b).abs().max() < 1e-6
        if chunk < 80:  # logits of at most one chunk alive (weights' grad is 300 x 16)
            assert max(largest) <= max(chunk * 300, 300 * 16, 80 * 16)
