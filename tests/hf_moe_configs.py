"""Public config.json values of the MoE model types meshtron/model/hf_moe_types.py reads (the
keys that set shapes), as the Hugging Face hub holds them, for tests/test_hf_moe_types.py."""

QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B
    "model_type": "qwen2_moe", "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "max_position_embeddings": 8192, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "vocab_size": 151936, "tie_word_embeddings": False, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "router_aux_loss_coef": 0.001, "use_sliding_window": False,
    "sliding_window": 32768,
}
QWEN2_57B_A14B = dict(  # Qwen/Qwen2-57B-A14B
    QWEN15_MOE_A27B, hidden_size=3584, intermediate_size=18944, moe_intermediate_size=2560,
    shared_expert_intermediate_size=20480, num_experts=64, num_experts_per_tok=8,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    max_position_embeddings=131072)
OLMOE_1B_7B = {  # allenai/OLMoE-1B-7B-0924
    "model_type": "olmoe", "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024,
    "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-05, "vocab_size": 50304,
    "tie_word_embeddings": False, "norm_topk_prob": False, "router_aux_loss_coef": 0.01,
    "clip_qkv": None, "attention_bias": False,
}
GPT_OSS_20B = {  # openai/gpt-oss-20b
    "model_type": "gpt_oss", "hidden_act": "silu", "hidden_size": 2880, "head_dim": 64,
    "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "num_hidden_layers": 24, "num_attention_heads": 64,
    "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "rms_norm_eps": 1e-05, "vocab_size": 201088, "tie_word_embeddings": False,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "swiglu_limit": 7.0, "attention_bias": True, "router_aux_loss_coef": 0.9,
    "initial_context_length": 4096,
}
GPT_OSS_120B = dict(GPT_OSS_20B, num_hidden_layers=36, num_local_experts=128,
                    layer_types=["sliding_attention", "full_attention"] * 18)
GRANITE_MOE_1B = {  # ibm-granite/granite-3.0-1b-a400m-base
    "model_type": "granitemoe", "hidden_act": "silu", "hidden_size": 1024,
    "intermediate_size": 512, "num_local_experts": 32, "num_experts_per_tok": 8,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8,
    "max_position_embeddings": 4096, "rope_theta": 10000, "rms_norm_eps": 1e-06,
    "vocab_size": 49155, "tie_word_embeddings": True, "attention_bias": False,
    "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
    "logits_scaling": 6.0, "router_aux_loss_coef": 0.001,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 2048, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "vocab_size": 151936, "tie_word_embeddings": False,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, "use_sliding_window": False,
}
TINY_QWEN2_MOE = dict(  # trains on a CPU: shared gate, dense blocks 0 and 2, MoE blocks 1, 3
    QWEN15_MOE_A27B, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
    num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, vocab_size=259, decoder_sparse_step=2, mlp_only_layers=[4],
    router_aux_loss_coef=0.01)
LLAMA4_SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E: its config.json's text_config (the
    # shape keys; rope_scaling's band factors as recalled, not re-read from the hub this session)
    "model_type": "llama4_text", "hidden_act": "silu", "hidden_size": 5120, "head_dim": 128,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "num_hidden_layers": 48,
    "num_attention_heads": 40, "num_key_value_heads": 8, "max_position_embeddings": 10485760,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 16.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192},
    "rms_norm_eps": 1e-05, "vocab_size": 202048, "tie_word_embeddings": False,
    "attention_chunk_size": 8192, "use_qk_norm": True, "attention_bias": False,
    "router_aux_loss_coef": 0.001,
}
LLAMA4_MAVERICK = dict(  # meta-llama/Llama-4-Maverick-17B-128E: text_config
    LLAMA4_SCOUT, num_local_experts=128, interleave_moe_layer_step=2,
    rope_scaling=None, max_position_embeddings=1048576)
