"""Public config.json values of dense Hugging Face models (the keys that shape the model), with
the parameter count each model card or paper states: fixtures of tests/test_hf_dense.py."""

from __future__ import annotations

PUBLIC = {
    # Qwen/Qwen3-8B: "Number of Parameters: 8.2B"
    "Qwen3-8B": (8.19e9, {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rope_theta": 1000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False,
        "sliding_window": None}),
    # Qwen/Qwen3-4B: "Number of Parameters: 4.0B"; head_dim 128 != 2560 / 32
    "Qwen3-4B": (4.02e9, {
        "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
        "rope_theta": 1000000, "rms_norm_eps": 1e-06, "tie_word_embeddings": True,
        "attention_bias": False, "hidden_act": "silu", "use_sliding_window": False}),
    # google/gemma-2-9b: 9.24B
    "gemma-2-9b": (9.24e9, {
        "model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336,
        "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "attention_bias": False}),
    # google/gemma-3-1b-pt: "1B" (999.9M)
    "gemma-3-1b": (1.00e9, {
        "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
        "rope_theta": 1000000, "rope_local_base_freq": 10000, "rms_norm_eps": 1e-06,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
        "sliding_window": 512, "sliding_window_pattern": 6, "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "rope_scaling": None}),
    # microsoft/Phi-3-mini-4k-instruct: 3.8B (3.82B)
    "Phi-3-mini-4k": (3.82e9, {
        "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 32064, "max_position_embeddings": 4096, "original_max_position_embeddings":
        4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
        "sliding_window": 2047, "tie_word_embeddings": False, "rope_scaling": None}),
    # allenai/OLMo-2-1124-7B: 7.30B
    "OLMo-2-1124-7B": (7.30e9, {
        "model_type": "olmo2", "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "vocab_size": 100352, "max_position_embeddings": 4096, "rope_theta": 500000,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False}),
    # ibm-granite/granite-3.0-8b-base: 8.17B
    "granite-3.0-8b": (8.17e9, {
        "model_type": "granite", "hidden_size": 4096, "intermediate_size": 12800,
        "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 49155, "max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-05, "hidden_act": "silu", "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
        "logits_scaling": 16.0, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": True}),
    # bigcode/starcoder2-15b: 15.96B
    "starcoder2-15b": (15.96e9, {
        "model_type": "starcoder2", "hidden_size": 6144, "intermediate_size": 24576,
        "num_hidden_layers": 40, "num_attention_heads": 48, "num_key_value_heads": 4,
        "vocab_size": 49152, "max_position_embeddings": 16384, "rope_theta": 100000,
        "norm_epsilon": 1e-05, "hidden_act": "gelu_pytorch_tanh", "use_bias": True,
        "sliding_window": 4096, "tie_word_embeddings": False}),
    # Nemotron-4 15B (Parmar et al. 2024, table 1 and section 2): 3.2B embedding and 12.5B
    # non-embedding parameters; 48 heads, 8 KV heads, squared ReLU, partial rotary 0.5
    "Nemotron-4-15B": (15.7e9, {
        "model_type": "nemotron", "hidden_size": 6144, "intermediate_size": 24576,
        "num_hidden_layers": 32, "num_attention_heads": 48, "num_key_value_heads": 8,
        "vocab_size": 256000, "max_position_embeddings": 4096, "rope_theta": 10000,
        "norm_eps": 1e-05, "hidden_act": "relu2", "partial_rotary_factor": 0.5,
        "tie_word_embeddings": False}),
}
