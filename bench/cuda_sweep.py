"""Correctness sweep: Hugging Face `transformers` architectures, eager vs fx2xla, on one device.

    PJRT_DEVICE=CUDA python3 bench/cuda_sweep.py --out $OUT/sweep.json          # H100
    .venv/bin/python bench/cuda_sweep.py --device cpu --models gpt2,llama --dtypes float32 --modes infer,train

Every model is built from a tiny config with random weights (nothing is downloaded): 2 layers,
hidden 64, 4 heads, vocab 512 (detection and segmentation models: 64 x 64 images, hidden 32), transformers' default attention implementation (SDPA where the
model has it), dropout 0 (config fields and every dropout module), `use_cache=False`. A model
whose config or model class the installed transformers lacks is recorded as "unavailable".

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
Every figure is recorded, pass or not. On CUDA, cuDNN's TF32 convolutions are turned off (torch
allows them by default) so that fp32 eager is a float32 reference; matmul precision is left at
torch's default ("highest").

Status per case: pass / mismatch / error (exception type, first 500 chars of its message, the
last traceback frames and the stage that raised: build, eager, reference, fx2xla, compare) /
unavailable / skipped (past `--deadline` seconds from process start, no new case starts).
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

import torch  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend; imported before jax touches the GPU)

# Relative-error tolerances per dtype.
#   float32: fx2xla vs eager, directly.
#   bfloat16 / float16: err(fx2xla vs fp32 reference) <= max(factor * err(eager vs fp32 reference), floor).
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"output": 1e-3, "loss": 1e-3, "grad": 1e-3},
    "bfloat16": {"factor": 4.0, "floor": 2e-2},
    "float16": {"factor": 4.0, "floor": 2e-2},
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("infer", "train")
VOCAB = 512
IMAGE = 32          # image models: 32 x 32 pixels, 3 channels
MEL_BINS, MEL_FRAMES = 16, 64   # Whisper: input features (max_source_positions = frames / 2)
AUDIO_SAMPLES = 1600            # Wav2Vec2: raw samples


# -- models ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Spec:
    name: str
    config_cls: str
    model_cls: str
    inputs: str                  # tokens | seq2seq | image | image64 | whisper | audio
    config: dict[str, Any]


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
    ]


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
    if spec.inputs == "whisper":
        return {"input_features": torch.randn(batch, MEL_BINS, MEL_FRAMES, generator=g), "decoder_input_ids": ids(seq)}
    if spec.inputs == "audio":
        return {"input_values": torch.randn(batch, AUDIO_SAMPLES, generator=g)}
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


def run_infer(model, inputs, dtype, device, stage: Stage) -> dict:
    is_fp32 = dtype == torch.float32

    def forward(m, inp):
        with torch.no_grad():
            return main_output(m(**inp)).float()

    stage.name = "eager"
    eager_model = copy.deepcopy(model).to(device, dtype).eval()
    eager = forward(eager_model, to_device(inputs, device, dtype))
    ref = None
    if not is_fp32:
        stage.name = "reference"
        ref = forward(copy.deepcopy(model).to(device, torch.float32).eval(), to_device(inputs, device, torch.float32))
    stage.name = "fx2xla"
    compiled = torch.compile(eager_model, backend="fx2xla")
    t0 = time.perf_counter()
    actual = forward(compiled, to_device(inputs, device, dtype))
    sync(device, actual)
    first = time.perf_counter() - t0
    stage.name = "compare"
    res: dict[str, Any] = {"first_call_s": round(first, 3), "output_shape": list(eager.shape)}
    if is_fp32:
        tol = TOLERANCES["float32"]["output"]
        res["errors"] = {"output": rel_err(actual, eager)}
        res["tolerance"] = {"output": tol}
        res["ok"] = res["errors"]["output"] <= tol
    else:
        t = TOLERANCES[dtype_name(dtype)]
        fx_err, eager_err = rel_err(actual, ref), rel_err(eager, ref)
        tol = max(t["factor"] * eager_err, t["floor"])
        res["errors"] = {"output": fx_err, "eager_output": eager_err, "output_vs_eager": rel_err(actual, eager)}
        res["tolerance"] = {"output": tol}
        res["ok"] = fx_err <= tol
    res["line"] = f"out {fmt(res['errors']['output'])}" + (
        "" if is_fp32 else f" (eager {fmt(res['errors']['eager_output'])})") + f" tol {fmt(res['tolerance']['output'])}"
    return res


def run_train(model, inputs, dtype, device, stage: Stage) -> dict:
    is_fp32 = dtype == torch.float32

    weights: list[torch.Tensor] = []   # drawn at the first output's shape, shared by every side

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        if not weights:
            g = torch.Generator().manual_seed(2)
            weights.append((2 * torch.rand(out.shape, generator=g)).to(device))
        return (out.float().pow(2) * weights[0]).mean()

    def step(m, compile_it=False):
        m.train()
        fn = torch.compile(m, backend="fx2xla") if compile_it else m
        inp = to_device(inputs, device, next(m.parameters()).dtype)
        t0 = time.perf_counter()
        loss = loss_of(main_output(fn(**inp)))
        loss.backward()
        sync(device, loss)
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}, time.perf_counter() - t0

    stage.name = "eager"
    eager_loss, eager_grads, _ = step(copy.deepcopy(model).to(device, dtype))
    if not is_fp32:
        stage.name = "reference"
        ref_loss, ref_grads, _ = step(copy.deepcopy(model).to(device, torch.float32))
    stage.name = "fx2xla"
    fx_loss, fx_grads, first = step(copy.deepcopy(model).to(device, dtype), compile_it=True)
    stage.name = "compare"
    res: dict[str, Any] = {"first_call_s": round(first, 3), "params": len(eager_grads),
                           "loss": {"eager": float(eager_loss), "fx2xla": float(fx_loss)}}
    if is_fp32:
        t = TOLERANCES["float32"]
        res["errors"] = {"loss": rel_err(fx_loss, eager_loss)}
        res["errors"]["grad"], res["worst_grad"] = worst(grad_errs(fx_grads, eager_grads))
        res["tolerance"] = {"loss": t["loss"], "grad": t["grad"]}
        ok_grad = res["errors"]["grad"] <= t["grad"]
        grad_line = f"grad {fmt(res['errors']['grad'])} tol {fmt(t['loss'])}/{fmt(t['grad'])}"
    else:
        # Per parameter: fx2xla's error vs the fp32 reference <= max(factor x eager's, floor). (One
        # bound from the worst over all parameters would let a grad that is ~0 in fp32, where
        # bf16 gives pure rounding noise, e.g. attention key biases, excuse any other error.)
        t = TOLERANCES[dtype_name(dtype)]
        res["loss"]["reference"] = float(ref_loss)
        fx_errs, eager_errs = grad_errs(fx_grads, ref_grads), grad_errs(eager_grads, ref_grads)
        bounds = {n: max(t["factor"] * eager_errs[n], t["floor"]) for n in fx_errs}
        ratios = {n: fx_errs[n] / bounds[n] for n in fx_errs}
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
        ok_grad = res["grad_ratio"] <= 1
        grad_line = (f"(eager {fmt(res['errors']['eager_loss'])}) grad {fmt(res['errors']['grad'])} "
                     f"(eager {fmt(res['errors']['eager_grad'])}) tol {fmt(res['tolerance']['loss'])}/per-param, "
                     f"worst err/tol {res['grad_ratio']:.2f} ({ratio_param})")
    res["ok"] = res["errors"]["loss"] <= res["tolerance"]["loss"] and ok_grad
    res["line"] = f"loss {fmt(res['errors']['loss'])} {grad_line}"
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
            except Exception as exc:  # noqa: BLE001  (recorded by each of its cases)
                model = exc
        for dtype_str in a.dtypes:
            for mode in a.modes:
                if time.monotonic() - PROCESS_START > a.deadline:
                    case = {"model": spec.name, "dtype": dtype_str, "mode": mode, "status": "skipped",
                            "reason": f"past the {a.deadline:.0f} s deadline"}
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
