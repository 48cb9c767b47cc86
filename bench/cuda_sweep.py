"""Correctness sweep: Hugging Face `transformers` architectures, eager vs fx2xla, on one device.

    PJRT_DEVICE=CUDA python3 bench/cuda_sweep.py --out $OUT/sweep.json          # H100
    .venv/bin/python bench/cuda_sweep.py --device cpu --models gpt2,llama --dtypes float32 --modes infer,train
    PJRT_DEVICE=CUDA python3 bench/cuda_sweep.py --start-at detr --deadline 300    # go on from a model

Every model is built from a tiny config with random weights (nothing is downloaded): 2 layers,
hidden 64, 4 heads, vocab 512 (images 32 x 32; detection and segmentation models 64 x 64, hidden
32; CNNs that downsample 32x, 128 x 128), transformers' default attention implementation (SDPA where the
model has it), dropout 0 (config fields and every dropout module), `use_cache=False`, batch
norms' scales near 1 and their running statistics taken from one training-mode forward on the
sweep's inputs (`calibrate_batch_norms`: untreated, some CNNs' eval outputs are exact zeros). A
model whose config or model class the installed transformers lacks is recorded as "unavailable".
An eager answer that is all zeros, or all below 1e-5, is an error ("nothing to compare"), never
a pass.

Cases: model x dtype (`--dtypes`) x mode (`--modes`), each against
`torch.compile(model, backend="fx2xla")`, with `torch._dynamo.reset()` between cases:
- infer: `model.eval()` under `torch.no_grad()`; the main output (logits, else last hidden state,
  else the first floating tensor) of eager and of fx2xla on the same inputs;
- train: one step on deep copies of one model (`model.train()`, dropout 0): forward, loss =
  mean(main output**2 * w) in fp32, with `w` a fixed random tensor of the output's shape with
  entries in [0, 2), backward; the losses and every parameter's grad. (The weights matter: an
  encoder whose output is a LayerNorm's has mean(output**2) ~= 1 whatever its inputs, so every
  grad upstream would be ~0 and its relative error rounding noise; and a signed projection
  mean(output * w) nearly cancels, so the loss's relative error would be noise instead.)

Errors are relative: err = max|a - e| / max(max|e|, 1e-6), per parameter for grads (a missing
grad counts as zeros; there the floor is GRAD_FLOOR of the model's largest gradient element,
as a bias right before a normalization has a gradient of exactly 0 and rounding noise on both
sides), reported as the worst over parameters. TOLERANCES below says what
passes: float32 compares fx2xla to eager directly; bfloat16 (or float16) compares both eager
and fx2xla at that dtype to an fp32 eager reference (a deep copy in fp32, same inputs) and
passes when fx2xla's error is at most max(factor x eager's error, floor), for the output, the
loss and each parameter's grad ("grad_ratio": the worst fx2xla error / its bound, <= 1 passes).
A float32 case that fails the direct comparison is judged the same way against a float64 eager
reference ("reference": "float64", the direct figures kept under "direct"): some random-weight
models are ill-conditioned in float32 (LeViT at 32 x 32 pixels: its batch norms over two
positions put eager's own float32 output 50% away from float64's; MobileViT's gradients 1e-2
away), and fx2xla should be judged by its distance from the exact answer, not from eager's
rounding.
Every figure is recorded, pass or not. On CUDA, cuDNN's TF32 convolutions are turned off (torch
allows them by default) so that fp32 eager is a float32 reference; matmul precision is left at
torch's default ("highest").

Status per case: pass / mismatch / error (exception type, first 500 chars of its message, the
last traceback frames and the stage that raised: build, eager, reference, fx2xla, compare) /
unavailable / skipped (past `--deadline` seconds from process start, no new case starts; or a
mode the model's spec rules out, with the reason).
Also per case: fx2xla's compile + first call seconds, Dynamo's graph count and graph breaks
(with their reasons), and the deltas of fx2xla.metrics()'s counts ("fallback_ops": eager
islands; "disk_hits": executables loaded from fx2xla's disk cache, which shorten the first call:
`FX2XLA_CACHE_DIR=""` turns that cache off for cold compile figures). The JSON (`--out`) holds
versions, device and the cases, and is rewritten after every case. Exit status 0 (it is a
report) unless the arguments are bad.
"""
from __future__ import annotations

import time

PROCESS_START = time.monotonic()

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend; imported before jax touches the GPU)

# Relative-error tolerances per dtype.
#   float32: fx2xla vs eager, directly (output, loss, grad); where that fails, as below against a
#     float64 reference (factor, floor): a model whose float32 eager answer is itself far from
#     float64's (a batch norm over two values) passes when fx2xla is no further from it.
#   bfloat16 / float16: err(fx2xla vs fp32 reference) <= max(factor * err(eager vs fp32 reference), floor).
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"output": 1e-3, "loss": 1e-3, "grad": 1e-3, "factor": 4.0, "floor": 1e-3},
    "bfloat16": {"factor": 4.0, "floor": 2e-2},
    "float16": {"factor": 4.0, "floor": 2e-2},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("infer", "train")
VOCAB = 512
IMAGE = 32          # image models: 32 x 32 pixels, 3 channels
MEL_BINS, MEL_FRAMES = 16, 64   # Whisper: input features (max_source_positions = frames / 2)
AUDIO_SAMPLES = 1600            # Wav2Vec2: raw samples
SERIES_LENGTH, SERIES_CHANNELS = 32, 3   # PatchTST: past values


# -- models ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Spec:
    name: str
    config_cls: str
    model_cls: str
    inputs: str                  # tokens | seq2seq | image | image64 | image128 | whisper | audio | frames | spectrogram | series
    config: dict[str, Any]
    # Cases that cannot be checked against eager, by "mode", "dtype" or "dtype mode" (eager has
    # no kernel, or eager and fx2xla both draw differently from the reference): recorded as
    # skipped, with why.
    skip: dict[str, str] = dataclasses.field(default_factory=dict)

    def skipped(self, dtype: str, mode: str) -> str | None:
        """Why the case (dtype, mode) is skipped, or None."""
        for key in (f"{dtype} {mode}", dtype, mode):
            if key in self.skip:
                return self.skip[key]
        return None


def model_specs(seq: int) -> list[Spec]:
    """The sweep's models, tiny configs; `seq` sets the position tables' size."""
    pos = max(128, 2 * seq + 2)
    lm = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=pos)
    enc = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=pos)
    vit = dict(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4)
    resnet = dict(model_type="resnet", embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                  out_features=["stage2", "stage3", "stage4"])
    T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)  # noqa: N806
    detr = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                encoder_attention_heads=2, decoder_attention_heads=2, num_queries=10, num_labels=5)
    return [
        # the required ones first, so that a deadline cuts the optional ones
        Spec("gpt2", "GPT2Config", "GPT2LMHeadModel", "tokens",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=pos,
                  bos_token_id=0, eos_token_id=0)),
        Spec("llama", "LlamaConfig", "LlamaForCausalLM", "tokens", lm | dict(num_key_value_heads=2)),
        Spec("bert", "BertConfig", "BertModel", "tokens", enc),
        Spec("t5", "T5Config", "T5ForConditionalGeneration", "seq2seq",
             dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                  num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
        Spec("vit", "ViTConfig", "ViTModel", "image", vit),
        Spec("mixtral", "MixtralConfig", "MixtralForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
        Spec("mistral", "MistralConfig", "MistralForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, sliding_window=16)),  # window 16 < seq 32
        # decoder LMs
        Spec("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, decoder_sparse_step=1)),
        Spec("gpt_neo", "GPTNeoConfig", "GPTNeoForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                  attention_types=[[["global", "local"], 1]], window_size=16, max_position_embeddings=pos,
                  bos_token_id=0, eos_token_id=0)),
        Spec("gptj", "GPTJConfig", "GPTJForCausalLM", "tokens",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=8, n_positions=pos,
                  bos_token_id=0, eos_token_id=0)),
        Spec("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", "tokens", lm | dict(rotary_pct=0.25)),
        Spec("opt", "OPTConfig", "OPTForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                  word_embed_proj_dim=64, max_position_embeddings=pos, pad_token_id=1, bos_token_id=2,
                  eos_token_id=2)),
        Spec("bloom", "BloomConfig", "BloomForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)),
        Spec("falcon", "FalconConfig", "FalconForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=pos)),
        Spec("phi", "PhiConfig", "PhiForCausalLM", "tokens", lm | dict(partial_rotary_factor=0.5)),
        Spec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "tokens", lm | dict(num_key_value_heads=2)),
        Spec("gemma", "GemmaConfig", "GemmaForCausalLM", "tokens", lm | dict(num_key_value_heads=2, head_dim=16)),
        Spec("gemma2", "Gemma2Config", "Gemma2ForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)),
        Spec("stablelm", "StableLmConfig", "StableLmForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, partial_rotary_factor=0.25)),
        Spec("mpt", "MptConfig", "MptForCausalLM", "tokens",
             dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=pos)),
        # encoders
        Spec("roberta", "RobertaConfig", "RobertaModel", "tokens", enc | dict(pad_token_id=1)),
        Spec("distilbert", "DistilBertConfig", "DistilBertModel", "tokens",
             dict(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=pos)),
        Spec("albert", "AlbertConfig", "AlbertModel", "tokens", enc | dict(embedding_size=32)),
        Spec("electra", "ElectraConfig", "ElectraModel", "tokens", enc | dict(embedding_size=32)),
        Spec("deberta_v2", "DebertaV2Config", "DebertaV2Model", "tokens",
             enc | dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16)),
        # encoder-decoders
        Spec("bart", "BartConfig", "BartForConditionalGeneration", "seq2seq",
             dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=pos,
                  pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)),
        Spec("whisper", "WhisperConfig", "WhisperModel", "whisper",
             dict(vocab_size=VOCAB, num_mel_bins=MEL_BINS, d_model=64, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                  max_source_positions=MEL_FRAMES // 2, max_target_positions=pos, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
                  begin_suppress_tokens=None)),
        # vision and audio
        Spec("clip_vision", "CLIPVisionConfig", "CLIPVisionModel", "image", vit),
        Spec("swin", "SwinConfig", "SwinModel", "image",
             dict(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
                  window_size=4)),
        Spec("convnext", "ConvNextConfig", "ConvNextModel", "image",
             dict(image_size=IMAGE, patch_size=4, num_channels=3, num_stages=2, hidden_sizes=[16, 32],
                  depths=[1, 1])),
        Spec("resnet", "ResNetConfig", "ResNetModel", "image",
             dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")),
        # detection and segmentation (grid sampling in the deformable attention of the last two)
        Spec("detr", "DetrConfig", "DetrForObjectDetection", "image64",
             dict(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=resnet | dict(out_features=["stage4"]),
                  **detr)),
        Spec("deformable_detr", "DeformableDetrConfig", "DeformableDetrForObjectDetection", "image64",
             dict(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=resnet, num_feature_levels=3,
                  encoder_n_points=2, decoder_n_points=2, **detr)),
        Spec("segformer", "SegformerConfig", "SegformerForSemanticSegmentation", "image64",
             dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                  decoder_hidden_size=32, num_labels=4, patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2])),
        Spec("mask2former", "Mask2FormerConfig", "Mask2FormerForUniversalSegmentation", "image64",
             dict(backbone_config=dict(model_type="swin", embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2],
                                       out_features=["stage1", "stage2", "stage3", "stage4"], image_size=64),
                  use_pretrained_backbone=False, feature_size=32, mask_feature_size=32, hidden_dim=32,
                  encoder_feedforward_dim=64, dim_feedforward=64, encoder_layers=1, decoder_layers=2, num_queries=10,
                  num_labels=5, num_attention_heads=2)),
        Spec("wav2vec2", "Wav2Vec2Config", "Wav2Vec2Model", "audio",
             dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4, mask_time_prob=0.0, mask_feature_prob=0.0,
                  apply_spec_augment=False)),
        # more decoder LMs: grouped and multi-query attention, QK norms, MoE routers, latent
        # attention, state-space layers (transformers' pure-torch paths: no custom kernels)
        Spec("phi3", "Phi3Config", "Phi3ForCausalLM", "tokens", lm | dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        Spec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "tokens", lm | dict(num_key_value_heads=2, head_dim=16)),
        Spec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, decoder_sparse_step=1)),
        Spec("olmo", "OlmoConfig", "OlmoForCausalLM", "tokens", lm | dict(pad_token_id=1, eos_token_id=2)),
        Spec("olmo2", "Olmo2Config", "Olmo2ForCausalLM", "tokens", lm | dict(pad_token_id=1, eos_token_id=2)),
        Spec("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "tokens",
             lm | dict(num_experts=4, num_experts_per_tok=2, pad_token_id=1, eos_token_id=2)),
        Spec("cohere", "CohereConfig", "CohereForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        Spec("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, bos_token_id=0, eos_token_id=0)),
        Spec("granite", "GraniteConfig", "GraniteForCausalLM", "tokens", lm | dict(num_key_value_heads=2)),
        Spec("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
        Spec("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)),
        Spec("glm4", "Glm4Config", "Glm4ForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, head_dim=16, pad_token_id=0)),
        Spec("helium", "HeliumConfig", "HeliumForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        Spec("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        Spec("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "tokens",
             lm | dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                       topk_group=1, moe_intermediate_size=64, first_k_dense_replace=1, n_shared_experts=1)),
        Spec("dbrx", "DbrxConfig", "DbrxForCausalLM", "tokens",
             dict(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=pos,
                  attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0), ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2))),
        Spec("gpt_bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", "tokens",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=pos, multi_query=True,
                  bos_token_id=0, eos_token_id=0)),
        Spec("codegen", "CodeGenConfig", "CodeGenForCausalLM", "tokens",
             dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, rotary_dim=8, n_positions=pos,
                  n_ctx=pos, bos_token_id=0, eos_token_id=0)),
        Spec("mamba", "MambaConfig", "MambaForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                  time_step_rank=8, use_mambapy=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)),
        Spec("mamba2", "Mamba2Config", "Mamba2ForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, head_dim=16,
                  num_heads=8, n_groups=1, chunk_size=16, conv_kernel=4, pad_token_id=0, bos_token_id=0,
                  eos_token_id=0)),
        Spec("jamba", "JambaConfig", "JambaForCausalLM", "tokens",
             lm | dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                       expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                       mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)),
        Spec("recurrent_gemma", "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, lru_width=64, attention_window_size=16,
                  conv1d_width=4, block_types=["recurrent", "attention"], pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)),
        # more encoders
        Spec("xlm_roberta", "XLMRobertaConfig", "XLMRobertaModel", "tokens", enc | dict(pad_token_id=1)),
        Spec("mpnet", "MPNetConfig", "MPNetModel", "tokens", enc | dict(pad_token_id=1)),
        Spec("ernie", "ErnieConfig", "ErnieModel", "tokens", enc),
        Spec("convbert", "ConvBertConfig", "ConvBertModel", "tokens", enc | dict(embedding_size=64)),
        Spec("squeezebert", "SqueezeBertConfig", "SqueezeBertModel", "tokens", enc | dict(embedding_size=64)),
        Spec("funnel", "FunnelConfig", "FunnelModel", "tokens",
             dict(vocab_size=VOCAB, d_model=64, n_head=4, d_head=16, d_inner=128, block_sizes=[1, 1],
                  num_decoder_layers=1)),
        Spec("xlnet", "XLNetConfig", "XLNetModel", "tokens",
             dict(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, d_inner=128)),
        Spec("big_bird", "BigBirdConfig", "BigBirdModel", "tokens",
             enc | dict(attention_type="block_sparse", block_size=2, num_random_blocks=1),
             skip={"train": "block-sparse attention draws its random blocks from NumPy in training, and under "
                            "Dynamo it draws others than eager (backend='eager' differs from eager too)"}),
        Spec("modernbert", "ModernBertConfig", "ModernBertModel", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=pos, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
        # more encoder-decoders
        Spec("mbart", "MBartConfig", "MBartForConditionalGeneration", "seq2seq", _seq2seq(pos, pad=1, bos=0, eos=2, start=2)),
        Spec("pegasus", "PegasusConfig", "PegasusForConditionalGeneration", "seq2seq", _seq2seq(pos, pad=0, bos=0, eos=1, start=0)),
        Spec("marian", "MarianConfig", "MarianMTModel", "seq2seq", _seq2seq(pos, pad=1, bos=0, eos=2, start=1)),
        Spec("m2m100", "M2M100Config", "M2M100ForConditionalGeneration", "seq2seq", _seq2seq(pos, pad=1, bos=0, eos=2, start=2)),
        Spec("blenderbot", "BlenderbotConfig", "BlenderbotForConditionalGeneration", "seq2seq",
             _seq2seq(pos, pad=0, bos=1, eos=2, start=1)),
        # more vision
        Spec("deit", "DeiTConfig", "DeiTModel", "image", vit),
        Spec("beit", "BeitConfig", "BeitModel", "image", vit | dict(use_relative_position_bias=True)),
        Spec("dinov2", "Dinov2Config", "Dinov2Model", "image", vit | dict(mlp_ratio=2)),
        Spec("siglip_vision", "SiglipVisionConfig", "SiglipVisionModel", "image", vit),
        Spec("yolos", "YolosConfig", "YolosModel", "image", vit | dict(image_size=[IMAGE, IMAGE], num_detection_tokens=5)),
        Spec("swinv2", "Swinv2Config", "Swinv2Model", "image",
             dict(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=32, depths=[1, 1], num_heads=[2, 4],
                  window_size=4)),
        Spec("convnextv2", "ConvNextV2Config", "ConvNextV2Model", "image",
             dict(image_size=IMAGE, patch_size=4, num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])),
        Spec("regnet", "RegNetConfig", "RegNetModel", "image",
             dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)),
        Spec("bit", "BitConfig", "BitModel", "image",
             dict(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck", num_groups=8)),
        # EfficientNet and MobileNetV2 downsample 32x: at 128 x 128 pixels their last batch norms
        # see 4 x 4 positions per image, not one (statistics of two values are rounding noise)
        Spec("efficientnet", "EfficientNetConfig", "EfficientNetModel", "image128",
             dict(image_size=4 * IMAGE, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)),
        Spec("mobilenet_v2", "MobileNetV2Config", "MobileNetV2Model", "image128",
             dict(image_size=4 * IMAGE, depth_multiplier=0.25)),
        Spec("mobilevit", "MobileViTConfig", "MobileViTForImageClassification", "image128",
             dict(image_size=4 * IMAGE, patch_size=2, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                  num_attention_heads=2)),
        Spec("levit", "LevitConfig", "LevitModel", "image128",
             dict(image_size=4 * IMAGE, hidden_sizes=[32, 48, 64], num_attention_heads=[1, 2, 2], depths=[1, 1, 1],
                  key_dim=[8, 8, 8])),
        Spec("poolformer", "PoolFormerConfig", "PoolFormerModel", "image",
             dict(num_channels=3, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1])),
        Spec("pvt", "PvtConfig", "PvtModel", "image",
             dict(image_size=IMAGE, num_encoder_blocks=2, depths=[1, 1], sequence_reduction_ratios=[2, 1],
                  hidden_sizes=[16, 32], patch_sizes=[4, 2], strides=[4, 2], num_attention_heads=[1, 2],
                  mlp_ratios=[2, 2])),
        # more audio
        Spec("hubert", "HubertConfig", "HubertModel", "audio", _audio()),
        Spec("wavlm", "WavLMConfig", "WavLMModel", "audio", _audio() | dict(num_buckets=32, max_bucket_distance=64)),
        Spec("data2vec_audio", "Data2VecAudioConfig", "Data2VecAudioModel", "audio", _audio()),
        Spec("sew", "SEWConfig", "SEWModel", "audio", _audio() | dict(squeeze_factor=2)),
        # encoders with unusual mixing: Fourier (FNet), rotary (RoFormer, ESM), hashed
        # characters and strided convolutions (CANINE), sliding chunks (Longformer)
        Spec("fnet", "FNetConfig", "FNetModel", "tokens",
             dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  max_position_embeddings=pos, pad_token_id=1, bos_token_id=0, eos_token_id=2),
             skip={"bfloat16": "eager's FFT has no bfloat16 kernel ('Unsupported dtype BFloat16')"}),
        Spec("esm", "EsmConfig", "EsmModel", "tokens",
             enc | dict(pad_token_id=1, mask_token_id=2, position_embedding_type="rotary", token_dropout=False)),
        Spec("roformer", "RoFormerConfig", "RoFormerModel", "tokens", enc | dict(embedding_size=64)),
        Spec("rembert", "RemBertConfig", "RemBertModel", "tokens",
             enc | dict(input_embedding_size=32, output_embedding_size=64, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)),
        Spec("megatron_bert", "MegatronBertConfig", "MegatronBertModel", "tokens", enc),
        Spec("canine", "CanineConfig", "CanineModel", "tokens",
             dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=pos, downsampling_rate=4, num_hash_buckets=VOCAB, upsampling_kernel_size=4,
                  local_transformer_stride=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        Spec("longformer", "LongformerConfig", "LongformerModel", "tokens",
             enc | dict(attention_window=8, pad_token_id=1, bos_token_id=0, eos_token_id=2, sep_token_id=2)),
        Spec("xglm", "XGLMConfig", "XGLMForCausalLM", "tokens",
             dict(vocab_size=VOCAB, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                  max_position_embeddings=pos, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
        # encoder-decoders: T5's relatives, local and transient-global attention, routed experts
        # (Switch, NLLB-MoE), n-gram streams (ProphetNet)
        Spec("mt5", "MT5Config", "MT5ForConditionalGeneration", "seq2seq", T5),
        Spec("umt5", "UMT5Config", "UMT5ForConditionalGeneration", "seq2seq", T5),
        # local attention: the transient-global kind fails in Dynamo's own trace with every
        # backend (a fake-tensor cat of mismatched batch sizes, torch 2.13)
        Spec("longt5", "LongT5Config", "LongT5ForConditionalGeneration", "seq2seq",
             T5 | dict(encoder_attention_type="local", local_radius=4)),
        Spec("switch_transformers", "SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", "seq2seq",
             T5 | dict(num_experts=4, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                       router_jitter_noise=0.0),
             skip={"bfloat16 train": "top-1 routing of random-weight tokens flips under bf16 rounding, in eager as in "
                                     "fx2xla: an expert's gradient then moves by a whole token's share (eager's own worst "
                                     "gradient error 0.16-0.42 over 5 input draws); float32 training checks the gradients"}),
        Spec("led", "LEDConfig", "LEDForConditionalGeneration", "seq2seq",
             {k: v for k, v in _seq2seq(pos, pad=1, bos=0, eos=2, start=2).items() if k != "max_position_embeddings"}
             | dict(max_encoder_position_embeddings=pos, max_decoder_position_embeddings=pos, attention_window=8)),
        Spec("nllb_moe", "NllbMoeConfig", "NllbMoeForConditionalGeneration", "seq2seq",
             _seq2seq(pos, pad=1, bos=0, eos=2, start=2) | dict(num_experts=4, expert_capacity=64, encoder_sparse_step=2,
                                                                decoder_sparse_step=2)),
        Spec("bigbird_pegasus", "BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration", "seq2seq",
             _seq2seq(pos, pad=0, bos=2, eos=1, start=0) | dict(attention_type="original_full")),
        Spec("prophetnet", "ProphetNetConfig", "ProphetNetForConditionalGeneration", "seq2seq",
             dict(vocab_size=VOCAB, hidden_size=64, encoder_ffn_dim=128, num_encoder_layers=2,
                  num_encoder_attention_heads=4, decoder_ffn_dim=128, num_decoder_layers=2,
                  num_decoder_attention_heads=4, max_position_embeddings=pos, ngram=2, num_buckets=8,
                  relative_max_distance=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0)),
        # dense prediction and more backbones
        Spec("dpt", "DPTConfig", "DPTForDepthEstimation", "image",
             vit | dict(num_hidden_layers=4, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[16, 32, 64, 64],
                        fusion_hidden_size=32, reassemble_factors=[4, 2, 1, 0.5],
                        initializer_range=0.1)),   # at 0.02 the depth head's output is 6e-8: nothing to compare
        Spec("depth_anything", "DepthAnythingConfig", "DepthAnythingForDepthEstimation", "image",
             dict(backbone_config=dict(model_type="dinov2", hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                       mlp_ratio=2, image_size=IMAGE, patch_size=8,
                                       out_indices=[1, 2, 3, 4], reshape_hidden_states=False),
                  patch_size=8, reassemble_hidden_size=32, neck_hidden_sizes=[16, 32, 64, 64], fusion_hidden_size=32,
                  head_hidden_size=16, initializer_range=0.1)),   # as DPT's
        Spec("upernet", "UperNetConfig", "UperNetForSemanticSegmentation", "image128",
             dict(backbone_config=dict(model_type="convnext", hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                       out_features=["stage1", "stage2", "stage3", "stage4"]),
                  hidden_size=32, use_auxiliary_head=False, num_labels=4)),
        Spec("glpn", "GLPNConfig", "GLPNForDepthEstimation", "image64",
             dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
                  strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=16)),
        Spec("conditional_detr", "ConditionalDetrConfig", "ConditionalDetrForObjectDetection", "image64",
             dict(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=resnet | dict(out_features=["stage4"]),
                  **detr)),
        Spec("cvt", "CvtConfig", "CvtModel", "image",
             dict(embed_dim=[16, 32], num_heads=[1, 2], depth=[2, 2], patch_sizes=[7, 3], patch_stride=[4, 2],
                  patch_padding=[2, 1], mlp_ratio=[2.0, 2.0], attention_drop_rate=[0.0, 0.0], drop_rate=[0.0, 0.0],
                  drop_path_rate=[0.0, 0.0], qkv_bias=[True, True], cls_token=[False, True],
                  qkv_projection_method=["dw_bn", "dw_bn"], kernel_qkv=[3, 3], padding_kv=[1, 1], stride_kv=[2, 2],
                  padding_q=[1, 1], stride_q=[1, 1])),
        Spec("focalnet", "FocalNetConfig", "FocalNetModel", "image",
             dict(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], hidden_sizes=[16, 32],
                  focal_levels=[2, 2], focal_windows=[3, 3])),
        Spec("mobilevitv2", "MobileViTV2Config", "MobileViTV2ForImageClassification", "image128",
             dict(image_size=4 * IMAGE, width_multiplier=0.25, num_labels=10)),
        # speech and signals
        Spec("unispeech", "UniSpeechConfig", "UniSpeechModel", "audio", _audio()),
        Spec("unispeech_sat", "UniSpeechSatConfig", "UniSpeechSatModel", "audio", _audio()),
        # relative positions: with rotary ones eager bf16 fails in transformers ("mat1 and mat2
        # must have the same dtype, but got Float and BFloat16")
        Spec("wav2vec2_conformer", "Wav2Vec2ConformerConfig", "Wav2Vec2ConformerModel", "audio",
             _audio() | dict(position_embeddings_type="relative", conv_depthwise_kernel_size=7)),
        Spec("speech_to_text", "Speech2TextConfig", "Speech2TextModel", "frames",
             dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_source_positions=MEL_FRAMES,
                  max_target_positions=pos, num_conv_layers=2, conv_kernel_sizes=[5, 5], conv_channels=32,
                  input_feat_per_channel=MEL_BINS, input_channels=1, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  decoder_start_token_id=2)),
        Spec("ast", "ASTConfig", "ASTModel", "spectrogram",
             dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, patch_size=8,
                  frequency_stride=4, time_stride=8, max_length=MEL_FRAMES, num_mel_bins=MEL_BINS)),
        Spec("patchtst", "PatchTSTConfig", "PatchTSTModel", "series",
             dict(num_input_channels=SERIES_CHANNELS, context_length=SERIES_LENGTH, patch_length=8, patch_stride=8,
                  num_hidden_layers=2, d_model=64, num_attention_heads=4, ffn_dim=128)),
    ]


def _seq2seq(pos: int, *, pad: int, bos: int, eos: int, start: int) -> dict[str, Any]:
    """A BART-shaped encoder-decoder config with the model family's special ids."""
    return dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=pos,
                pad_token_id=pad, bos_token_id=bos, eos_token_id=eos, decoder_start_token_id=start)


def _audio() -> dict[str, Any]:
    """A Wav2Vec2-shaped speech encoder config (the feature extractor's convolutions included)."""
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                num_conv_pos_embedding_groups=4, mask_time_prob=0.0, mask_feature_prob=0.0, apply_spec_augment=False)


def _zero_dropout_fields(config) -> None:
    """Every float config field about dropout, layer drop or drop path -> 0 (nested configs too)."""
    import transformers

    config_base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and "drop" in key:
            setattr(config, key, 0.0)
        elif isinstance(value, config_base):
            _zero_dropout_fields(value)


def _zero_dropout_modules(model: torch.nn.Module) -> None:
    """p = 0 on every dropout module, and 0 for float attributes a module reads as a dropout
    rate (`self.dropout = config.attention_dropout`, `drop_prob`, `layerdrop`)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for key, value in list(vars(m).items()):
            if isinstance(value, float) and "drop" in key.lower():
                setattr(m, key, 0.0)


class Unavailable(Exception):
    pass


def build(spec: Spec) -> torch.nn.Module:
    """The model of `spec` on the CPU in fp32, seeded, dropout 0."""
    import transformers

    def lookup(name):
        try:
            return getattr(transformers, name, None)
        except Exception:  # noqa: BLE001  (a lazy import whose optional dependency is missing)
            return None

    config_cls, model_cls = lookup(spec.config_cls), lookup(spec.model_cls)
    if config_cls is None or model_cls is None:
        missing = spec.config_cls if config_cls is None else spec.model_cls
        raise Unavailable(f"transformers {transformers.__version__} has no {missing}")
    config = config_cls(**spec.config)
    _zero_dropout_fields(config)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    torch.manual_seed(0)
    model = model_cls(config)
    _zero_dropout_modules(model)
    return model.float()


def calibrate_batch_norms(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """Batch norms' scales near 1 and their running statistics := those of one training-mode
    forward on `inputs`.

    Freshly initialized, a batch norm's running statistics are mean 0 and variance 1, so in eval
    mode it passes its input through unscaled; with small random weights the activations of a
    deep CNN then shrink layer by layer. transformers also draws some models' batch-norm scales
    from N(0, 0.02) (EfficientNet, MobileViT), and zeroes others (LeViT's residual projections),
    which shrinks them in training mode too. Untreated, MobileViT's and EfficientNet's outputs
    come out as exact zeros (MobileNetV2's as 1e-26): a comparison of nothing. After this, every
    batch norm scales by 1 + N(0, 0.1^2), shifts by N(0, 0.1^2) (seeded) and, in eval mode,
    normalizes as a trained model would. A no-op for a model without batch norms."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in norms:
            if m.affine:
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    norms = [m for m in norms if m.track_running_stats]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None              # a cumulative average: one batch sets the statistics outright
    was_training = model.training
    model.train()
    with torch.no_grad():
        model(**inputs)
    model.train(was_training)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
        m.num_batches_tracked.zero_()


def make_inputs(spec: Spec, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Inputs on the CPU, fp32 for floating ones; token ids avoid the special ids 0-3."""
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(4, VOCAB, (batch, n), generator=g)

    if spec.inputs == "tokens":
        return {"input_ids": ids(seq)}
    if spec.inputs == "seq2seq":
        return {"input_ids": ids(seq), "decoder_input_ids": ids(seq)}
    if spec.inputs == "image":
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=g)}
    if spec.inputs == "image64":  # detection and segmentation: feature maps down to 1/32
        return {"pixel_values": torch.randn(batch, 3, 2 * IMAGE, 2 * IMAGE, generator=g)}
    if spec.inputs == "image128":  # batch norms over the last stages' few positions: enough of them
        return {"pixel_values": torch.randn(batch, 3, 4 * IMAGE, 4 * IMAGE, generator=g)}
    if spec.inputs == "whisper":
        return {"input_features": torch.randn(batch, MEL_BINS, MEL_FRAMES, generator=g), "decoder_input_ids": ids(seq)}
    if spec.inputs == "audio":
        return {"input_values": torch.randn(batch, AUDIO_SAMPLES, generator=g)}
    if spec.inputs == "frames":      # Speech2Text: filter-bank frames, time first
        return {"input_features": torch.randn(batch, MEL_FRAMES, MEL_BINS, generator=g), "decoder_input_ids": ids(seq)}
    if spec.inputs == "spectrogram":  # AST: one spectrogram per example, time first
        return {"input_values": torch.randn(batch, MEL_FRAMES, MEL_BINS, generator=g)}
    if spec.inputs == "series":
        return {"past_values": torch.randn(batch, SERIES_LENGTH, SERIES_CHANNELS, generator=g)}
    raise ValueError(spec.inputs)


def to_device(inputs: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}


# -- comparing -------------------------------------------------------------------------------

def main_output(out) -> torch.Tensor:
    """logits, else last_hidden_state, else the first floating tensor of the output."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, dict) else getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return value
    items = out.to_tuple() if hasattr(out, "to_tuple") else out.values() if isinstance(out, dict) else out
    for value in items:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(f"no floating tensor in the output ({type(out).__name__})")


def rel_err(actual: torch.Tensor | None, expected: torch.Tensor | None, floor: float = 1e-6) -> float:
    """max|a - e| / max(max|e|, floor); None counts as zeros; NaN where either has a NaN."""
    if actual is None and expected is None:
        return 0.0
    if actual is None:
        actual = torch.zeros_like(expected)
    if expected is None:
        expected = torch.zeros_like(actual)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if expected.numel() == 0:
        return 0.0
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("nan")
    return float((a - e).abs().max() / max(float(e.abs().max()), floor))


# A parameter's gradient is compared relative to its own largest element, but never to less than
# this fraction of the model's largest gradient element: the gradient of a bias right before a
# normalization (a convolution's before GroupNorm, a key projection's before softmax) is 0 in
# exact arithmetic, and both sides give rounding noise of ~1e-9 there.
GRAD_FLOOR = 1e-4


def grad_errs(actual: dict, expected: dict) -> dict[str, float]:
    """rel_err of each parameter's grad (floor: GRAD_FLOOR of the largest expected element)."""
    largest = max((float(g.detach().abs().max()) for g in expected.values() if g is not None and g.numel()),
                  default=0.0)
    floor = max(GRAD_FLOOR * largest, 1e-6)
    return {n: rel_err(actual[n], expected[n], floor) for n in expected}


def worst(errs: dict[str, float]) -> tuple[float, str | None]:
    """The largest value (NaN wins) and its key."""
    value, key = 0.0, None
    for k, v in errs.items():
        if v != v:
            return v, k
        if v > value:
            value, key = v, k
    return value, key


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


# -- one case --------------------------------------------------------------------------------

def sync(device: torch.device, value: torch.Tensor | None = None) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif value is not None and value.numel():
        value.reshape(-1)[0].item()


def dynamo_counts() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "breaks": dict(counters["graph_break"])}


def fx2xla_counts() -> dict[str, int]:
    try:
        return {k: v for k, v in fx2xla.metrics().items() if isinstance(v, int) and not isinstance(v, bool)}
    except Exception:  # noqa: BLE001
        return {}


class Stage:
    """The stage a case is in, for its error record."""
    name = "build"


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """What an answer at `dtype` is checked against: float64 for float32, float32 otherwise."""
    return torch.float64 if dtype == torch.float32 else torch.float32


def widened(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least (a float64 reference stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def nonzero(eager: torch.Tensor) -> None:
    """Raises where eager's answer is all zeros, or so small that errors are measured against
    rel_err's floor (1e-6) instead of against it: equal to it would prove nothing."""
    largest = float(eager.detach().abs().max()) if eager.numel() else 0.0
    if not largest > 1e-5:
        raise ValueError(f"eager's answer (shape {tuple(eager.shape)}) is all zeros or below 1e-5 "
                         f"(largest |value| {largest:.1e}): nothing to compare")


def run_infer(model, inputs, dtype, device, stage: Stage) -> dict:
    is_fp32 = dtype == torch.float32

    def forward(m, inp):
        with torch.no_grad():
            return widened(main_output(m(**inp)))

    stage.name = "eager"
    eager_model = copy.deepcopy(model).to(device, dtype).eval()
    eager = forward(eager_model, to_device(inputs, device, dtype))
    stage.name = "fx2xla"
    compiled = torch.compile(eager_model, backend="fx2xla")
    t0 = time.perf_counter()
    actual = forward(compiled, to_device(inputs, device, dtype))
    sync(device, actual)
    first = time.perf_counter() - t0
    stage.name = "compare"
    nonzero(eager)
    res: dict[str, Any] = {"first_call_s": round(first, 3), "output_shape": list(eager.shape)}
    if is_fp32:
        tol = TOLERANCES["float32"]["output"]
        res["errors"] = {"output": rel_err(actual, eager)}
        res["tolerance"] = {"output": tol}
        res["ok"] = res["errors"]["output"] <= tol
        res["line"] = f"out {fmt(res['errors']['output'])} tol {fmt(tol)}"
        if res["ok"]:
            return res
        res["direct"] = {"errors": res.pop("errors"), "tolerance": res.pop("tolerance"), "line": res.pop("line")}
    stage.name = "reference"
    rdtype = reference_dtype(dtype)
    ref = forward(copy.deepcopy(model).to(device, rdtype).eval(), to_device(inputs, device, rdtype))
    stage.name = "compare"
    t = TOLERANCES[dtype_name(dtype)]
    fx_err, eager_err = rel_err(actual, ref), rel_err(eager, ref)
    tol = max(t["factor"] * eager_err, t["floor"])
    res["reference"] = dtype_name(rdtype)
    res["errors"] = {"output": fx_err, "eager_output": eager_err, "output_vs_eager": rel_err(actual, eager)}
    res["tolerance"] = {"output": tol}
    res["ok"] = fx_err <= tol
    res["line"] = (f"out {fmt(fx_err)} (eager {fmt(eager_err)}) vs {dtype_name(rdtype)} tol {fmt(tol)}"
                   + (f"; vs eager {res['direct']['line']}" if is_fp32 else ""))
    return res


def run_train(model, inputs, dtype, device, stage: Stage) -> dict:
    is_fp32 = dtype == torch.float32

    weights: list[torch.Tensor] = []   # drawn at the first output's shape, shared by every side
    outputs: list[torch.Tensor] = []   # each side's main output (eager's first)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        if not weights:
            g = torch.Generator().manual_seed(2)
            weights.append((2 * torch.rand(out.shape, generator=g)).to(device))
        return (widened(out).pow(2) * weights[0]).mean()

    def step(m, compile_it=False):
        m.train()
        # The same random draws on every side where a model draws in training (BigBird's random
        # attention blocks come from NumPy's global generator).
        torch.manual_seed(4)
        np.random.seed(4)
        fn = torch.compile(m, backend="fx2xla") if compile_it else m
        inp = to_device(inputs, device, next(m.parameters()).dtype)
        t0 = time.perf_counter()
        out = main_output(fn(**inp))
        loss = loss_of(out)
        loss.backward()
        sync(device, loss)
        outputs.append(out.detach())
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, time.perf_counter() - t0

    stage.name = "eager"
    eager_loss, eager_grads, _ = step(copy.deepcopy(model).to(device, dtype))
    stage.name = "fx2xla"
    fx_loss, fx_grads, first = step(copy.deepcopy(model).to(device, dtype), compile_it=True)
    stage.name = "compare"
    nonzero(outputs[0])
    res: dict[str, Any] = {"first_call_s": round(first, 3), "params": len(eager_grads),
                           "loss": {"eager": float(eager_loss), "fx2xla": float(fx_loss)}}
    if is_fp32:
        t = TOLERANCES["float32"]
        res["errors"] = {"loss": rel_err(fx_loss, eager_loss)}
        res["errors"]["grad"], res["worst_grad"] = worst(grad_errs(fx_grads, eager_grads))
        res["tolerance"] = {"loss": t["loss"], "grad": t["grad"]}
        res["ok"] = res["errors"]["loss"] <= t["loss"] and res["errors"]["grad"] <= t["grad"]
        res["line"] = (f"loss {fmt(res['errors']['loss'])} grad {fmt(res['errors']['grad'])} "
                       f"tol {fmt(t['loss'])}/{fmt(t['grad'])}")
        if res["ok"]:
            return res
        res["direct"] = {k: res.pop(k) for k in ("errors", "worst_grad", "tolerance", "line")}
    # Against the reference, per parameter: fx2xla's error <= max(factor x eager's, floor). (One
    # bound from the worst over all parameters would let a grad that is ~0 in fp32, where bf16
    # gives pure rounding noise, e.g. attention key biases, excuse any other error.)
    stage.name = "reference"
    rdtype = reference_dtype(dtype)
    ref_loss, ref_grads, _ = step(copy.deepcopy(model).to(device, rdtype))
    stage.name = "compare"
    t = TOLERANCES[dtype_name(dtype)]
    res["reference"] = dtype_name(rdtype)
    res["loss"]["reference"] = float(ref_loss)
    fx_errs, eager_errs = grad_errs(fx_grads, ref_grads), grad_errs(eager_grads, ref_grads)
    bounds = {n: max(t["factor"] * eager_errs[n], t["floor"]) for n in fx_errs}
    ratios = {n: fx_errs[n] / bounds[n] if bounds[n] else 0.0 if fx_errs[n] == 0 else float("inf") for n in fx_errs}
    res["errors"] = {"loss": rel_err(fx_loss, ref_loss), "eager_loss": rel_err(eager_loss, ref_loss)}
    res["errors"]["grad"], res["worst_grad"] = worst(fx_errs)
    res["errors"]["eager_grad"], res["eager_worst_grad"] = worst(eager_errs)
    res["errors"]["grad_vs_eager"] = worst(grad_errs(fx_grads, eager_grads))[0]
    res["grad_ratio"], ratio_param = worst(ratios)   # <= 1 passes
    res["tolerance"] = {"loss": max(t["factor"] * res["errors"]["eager_loss"], t["floor"]),
                        "grad": "per parameter: max(factor x eager's error, floor)"}
    over = sorted((n for n in ratios if not ratios[n] <= 1), reverse=True,
                  key=lambda n: ratios[n] if ratios[n] == ratios[n] else float("inf"))   # NaN first
    res["grads_over_tolerance"] = [{"param": n, "err": fx_errs[n], "eager_err": eager_errs[n], "tol": bounds[n]}
                                   for n in over[:5]]
    res["ok"] = res["errors"]["loss"] <= res["tolerance"]["loss"] and res["grad_ratio"] <= 1
    res["line"] = (f"loss {fmt(res['errors']['loss'])} (eager {fmt(res['errors']['eager_loss'])}) "
                   f"grad {fmt(res['errors']['grad'])} (eager {fmt(res['errors']['eager_grad'])}) "
                   f"vs {dtype_name(rdtype)} tol {fmt(res['tolerance']['loss'])}/per-param, "
                   f"worst err/tol {res['grad_ratio']:.2f} ({ratio_param})"
                   + (f"; vs eager {res['direct']['line']}" if is_fp32 else ""))
    return res


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def short_traceback(exc: BaseException, frames: int = 4) -> list[str]:
    cwd = os.getcwd()
    return [f"{os.path.relpath(f.filename) if f.filename.startswith(cwd) else f.filename}:{f.lineno} in {f.name}"
            for f in traceback.extract_tb(exc.__traceback__)[-frames:]]


def run_case(spec: Spec, model_or_exc, inputs, dtype_str: str, mode: str, device: torch.device) -> dict:
    case: dict[str, Any] = {"model": spec.name, "dtype": dtype_str, "mode": mode}
    if isinstance(model_or_exc, Unavailable):
        case.update(status="unavailable", reason=str(model_or_exc))
        return case
    stage = Stage()
    torch._dynamo.reset()
    dynamo_before, fx_before = dynamo_counts(), fx2xla_counts()
    t0 = time.perf_counter()
    try:
        if isinstance(model_or_exc, BaseException):
            raise model_or_exc
        run = run_infer if mode == "infer" else run_train
        res = run(model_or_exc, inputs, DTYPES[dtype_str], device, stage)
        case["status"] = "pass" if res.pop("ok") else "mismatch"
        case.update(res)
    except Exception as exc:  # noqa: BLE001  (one case's failure never stops the sweep)
        case["status"] = "error"
        case["error"] = {"stage": stage.name, "type": type(exc).__name__, "message": str(exc)[:500],
                         "traceback": short_traceback(exc)}
        case["line"] = f"[{stage.name}] {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    case["seconds"] = round(time.perf_counter() - t0, 3)
    try:
        after = dynamo_counts()
        new_breaks = {r: n - dynamo_before["breaks"].get(r, 0) for r, n in after["breaks"].items()}
        case["dynamo"] = {"graphs": after["graphs"] - dynamo_before["graphs"],
                          "graph_breaks": sum(new_breaks.values()),
                          "break_reasons": [r[:200] for r, n in new_breaks.items() if n > 0][:5]}
        fx_after = fx2xla_counts()
        case["fx2xla"] = {k: v - fx_before.get(k, 0) for k, v in fx_after.items() if v - fx_before.get(k, 0) > 0}
    except Exception as exc:  # noqa: BLE001
        case["counts_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return case


# -- the sweep -------------------------------------------------------------------------------

def versions(device: torch.device) -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "device": str(device), "host": platform.node()}
    for pkg in ("jax", "jaxlib", "transformers", "fx2xla", "jax-cuda13-plugin", "jax-cuda12-plugin",
                "jax-cuda13-pjrt", "jax-cuda12-pjrt"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    out["PJRT_DEVICE"] = os.environ.get("PJRT_DEVICE")
    out["cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
    out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    return out


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)


def parse_args(argv=None):
    names = [s.name for s in model_specs(32)]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default="float32,bfloat16", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--modes", default="infer,train", help="comma list of infer, train")
    p.add_argument("--models", default="", help=f"comma list (default all): {', '.join(names)}")
    p.add_argument("--start-at", default="", metavar="MODEL",
                   help="only the models from MODEL on, in the order of --models (or the sweep's): to go on "
                        "where a run that met its deadline stopped")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (image and audio models have fixed sizes)")
    p.add_argument("--out", default="bench/results/cuda_sweep.json")
    p.add_argument("--deadline", type=float, default=480.0,
                   help="no case starts later than this many seconds from process start")
    a = p.parse_args(argv)

    def split(s):
        return [x.strip() for x in s.split(",") if x.strip()]

    a.dtypes, a.modes, a.models = split(a.dtypes), split(a.modes), split(a.models) or names
    for kind, given, known in (("dtype", a.dtypes, DTYPES), ("mode", a.modes, MODES), ("model", a.models, names)):
        bad = [x for x in given if x not in known]
        if bad or not given:
            p.error(f"unknown {kind} {', '.join(bad) or '(none given)'}; known: {', '.join(known)}")
    if a.start_at:
        if a.start_at not in a.models:
            p.error(f"--start-at {a.start_at}: not among the models to run ({', '.join(a.models)})")
        a.models = a.models[a.models.index(a.start_at):]
    try:
        a.device = torch.device(a.device)
    except RuntimeError as e:
        p.error(str(e))
    if a.device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    if a.batch < 1 or a.seq < 1:
        p.error("--batch and --seq must be positive")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    if a.device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False   # fp32 eager convolutions: a float32 reference
    by_name = {s.name: s for s in model_specs(a.seq)}
    specs = [by_name[n] for n in dict.fromkeys(a.models)]  # in the order given: a deadline cuts the last ones
    payload: dict[str, Any] = {
        "versions": versions(a.device),
        "args": {k: str(v) if isinstance(v, torch.device) else v for k, v in vars(a).items()},
        "tolerances": TOLERANCES, "cases": [],
    }
    print(f"fx2xla sweep on {a.device}: {len(specs)} models x {a.dtypes} x {a.modes}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}, jax {payload['versions'].get('jax')}",
          flush=True)
    for spec in specs:
        model: Any = None
        inputs = None
        if time.monotonic() - PROCESS_START <= a.deadline:
            try:
                model = build(spec)
                inputs = make_inputs(spec, a.batch, a.seq)
                calibrate_batch_norms(model, inputs)
            except Exception as exc:  # noqa: BLE001  (recorded by each of its cases)
                model = exc
        for dtype_str in a.dtypes:
            for mode in a.modes:
                if time.monotonic() - PROCESS_START > a.deadline:
                    case = {"model": spec.name, "dtype": dtype_str, "mode": mode, "status": "skipped",
                            "reason": f"past the {a.deadline:.0f} s deadline"}
                elif spec.skipped(dtype_str, mode):
                    case = {"model": spec.name, "dtype": dtype_str, "mode": mode, "status": "skipped",
                            "reason": spec.skipped(dtype_str, mode)}
                else:
                    case = run_case(spec, model, inputs, dtype_str, mode, a.device)
                payload["cases"].append(case)
                write_json(a.out, payload)
                detail = case.get("line") or case.get("reason", "")
                dyn = case.get("dynamo", {})
                counts = f" graphs {dyn['graphs']} breaks {dyn['graph_breaks']}" if dyn else ""
                if case.get("fx2xla", {}).get("fallback_ops"):
                    counts += f" fx2xla-fallbacks {case['fx2xla']['fallback_ops']}"
                secs = f" first {case['first_call_s']:.1f}s" if "first_call_s" in case else ""
                total = f" total {case['seconds']:.1f}s" if "seconds" in case else ""
                print(f"{spec.name:12s} {dtype_str:9s} {mode:5s} {case['status']:11s} {detail}{secs}{total}{counts}",
                      flush=True)
                gc.collect()
                if a.device.type == "cuda":
                    torch.cuda.empty_cache()
        del model
        gc.collect()
    torch._dynamo.reset()

    cases = payload["cases"]
    by_status: dict[str, int] = {}
    for c in cases:
        by_status[c["status"]] = by_status.get(c["status"], 0) + 1
    failed = [c for c in cases if c["status"] in ("mismatch", "error")]
    payload["summary"] = {"passed": by_status.get("pass", 0), "failed": len(failed), "by_status": by_status,
                          "failures": [f"{c['model']} {c['dtype']} {c['mode']}: {c['status']} {c.get('line', '')}"
                                       for c in failed],
                          "elapsed_s": round(time.monotonic() - PROCESS_START, 1)}
    write_json(a.out, payload)
    print(f"\n{by_status.get('pass', 0)} passed, {len(failed)} failed"
          + "".join(f", {n} {s}" for s, n in by_status.items() if s not in ("pass", "mismatch", "error"))
          + f" ({payload['summary']['elapsed_s']} s); JSON: {a.out}")
    for line in payload["summary"]["failures"]:
        print(f"  FAIL {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
