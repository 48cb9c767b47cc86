"""Reference models for fx2xla's tests, demo and benchmarks: real architectures with random
weights, built from configs (needs `transformers`; nothing is downloaded)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], torch.nn.Module]
    make_inputs: Callable[[], tuple]


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def mlp(d_in: int = 1024, d_hidden: int = 4096, d_out: int = 1024) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, d_hidden), torch.nn.GELU(), torch.nn.Linear(d_hidden, d_out)
    )


class SmallCNN(torch.nn.Module):
    """conv -> batch norm -> relu -> max pool, twice, then adaptive average pool and a head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, stride=2), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        )
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.head = torch.nn.Linear(64, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class NormBlock(torch.nn.Module):
    """linear -> batch norm -> relu, plus the input: a residual block with buffers (running
    statistics) it updates in place in training."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x))) + x


def gpt2(layers=4, hidden=256, heads=4, vocab=1000, positions=256):
    tf = _quiet_transformers()
    cfg = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                        n_positions=positions, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


def bert(layers=4, hidden=256, heads=4, vocab=1000, positions=256):
    tf = _quiet_transformers()
    cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        intermediate_size=4 * hidden, vocab_size=vocab, max_position_embeddings=positions)
    return tf.BertModel(cfg)


def llama(layers=4, hidden=256, heads=4, kv_heads=2, vocab=1000, positions=256):
    tf = _quiet_transformers()
    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=688, vocab_size=vocab,
                         max_position_embeddings=positions, bos_token_id=0, eos_token_id=0)
    return tf.LlamaForCausalLM(cfg)


def mixtral(layers=4, hidden=256, heads=4, kv_heads=2, experts=8, top_k=2, vocab=1000, positions=256):
    """A transformers Mixtral (mixture of experts: `experts` SwiGLU experts of width 688 per layer,
    each token routed to `top_k` of them)."""
    tf = _quiet_transformers()
    cfg = tf.MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, intermediate_size=688, num_local_experts=experts,
                           num_experts_per_tok=top_k, vocab_size=vocab, max_position_embeddings=positions,
                           bos_token_id=0, eos_token_id=0)
    return tf.MixtralForCausalLM(cfg)


def resnet(hidden=(32, 64, 128, 256), depths=(2, 2, 2, 2), classes=10):
    """A transformers ResNet (ResNet-18's basic blocks and depths, narrower), classifying."""
    tf = _quiet_transformers()
    cfg = tf.ResNetConfig(num_channels=3, embedding_size=hidden[0], hidden_sizes=list(hidden),
                          depths=list(depths), layer_type="basic", num_labels=classes)
    return tf.ResNetForImageClassification(cfg)


class ImageLogits(torch.nn.Module):
    """Wraps a transformers vision classifier so it takes pixels and returns its logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


class LogitsOnly(torch.nn.Module):
    """Wraps a transformers model so it returns one tensor (logits / last hidden state)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        out = self.model(input_ids=input_ids, use_cache=False) if _takes_use_cache(self.model) else self.model(input_ids=input_ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _takes_use_cache(model) -> bool:
    return type(model).__name__ != "BertModel"


def token_ids(batch=4, seq=128, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def model_cases(batch=4, seq=128, layers=4, hidden=256) -> list[ModelCase]:
    """The benchmark/demo configurations: MLP, CNN, a transformers ResNet, GPT-2, BERT, LLaMA
    (random weights)."""
    return [
        ModelCase("mlp", mlp, lambda: (torch.randn(32, 1024),)),
        ModelCase("cnn", SmallCNN, lambda: (torch.randn(8, 3, 64, 64),)),
        ModelCase("resnet", lambda: ImageLogits(resnet()), lambda: (torch.randn(8, 3, 64, 64),)),
        ModelCase("gpt2", lambda: LogitsOnly(gpt2(layers, hidden)), lambda: (token_ids(batch, seq),)),
        ModelCase("bert", lambda: LogitsOnly(bert(layers, hidden)), lambda: (token_ids(batch, seq),)),
        ModelCase("llama", lambda: LogitsOnly(llama(layers, hidden)), lambda: (token_ids(batch, seq),)),
    ]
