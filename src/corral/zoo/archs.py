"""The architectures of the model zoo: for each, the metadata llama.cpp reads and the tensors it
loads, as llama.cpp's own loaders (`src/models/*.cpp`) name and shape them, at any size.

Shapes are in ggml's order (`ne0` first), as llama.cpp's sources write them: `[n_embd, n_ff]` is
a matrix of `n_ff` rows of `n_embd`. Only what a real converted model carries is written (no
optional tensors a real file lacks), so that memory, load and prefill costs are a real model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

Shape = tuple[int, ...]
Tensors = list[tuple[str, Shape]]


@dataclass(frozen=True, slots=True)
class Dims:
    """The size knobs of one zoo model; each architecture reads the ones it has."""

    embd: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ff: int
    vocab: int
    context: int = 131072
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    shared_ff: int = 0
    window: int = 0  # sliding-window attention: tokens a windowed layer sees
    ssm_state: int = 128  # recurrent layers: state (head) size
    ssm_groups: int = 1  # Gated DeltaNet: key heads; Mamba-2: groups
    ssm_heads: int = 2  # Gated DeltaNet: value heads; Mamba-2: heads
    lora_q: int = 0  # MLA: query and key-value compression ranks
    lora_kv: int = 512


@dataclass(frozen=True, slots=True)
class Arch:
    """One architecture: `name` is GGUF's `general.architecture`; `kind` what it stands for."""

    name: str
    kind: str
    dims: Callable[[int, int, int], Dims]  # (embd, layers, vocab) -> its family's shape
    metadata: Callable[[Dims], dict[str, Any]]  # keys under `{name}.`
    tensors: Callable[[Dims], Tensors]
    vocab: int  # its family's vocabulary (sized files; tiny ones take a small one)
    tied: bool = False  # output projection shared with the token embeddings


def _common(d: Dims) -> dict[str, Any]:
    return {
        "context_length": d.context,
        "embedding_length": d.embd,
        "block_count": d.layers,
        "feed_forward_length": d.ff,
        "attention.head_count": d.heads,
        "attention.head_count_kv": d.kv_heads,
        "attention.key_length": d.head_dim,
        "attention.value_length": d.head_dim,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1_000_000.0,
    }


def _ends(d: Dims, tied: bool) -> Tensors:
    out: Tensors = [("token_embd.weight", (d.embd, d.vocab)), ("output_norm.weight", (d.embd,))]
    return out if tied else [*out, ("output.weight", (d.embd, d.vocab))]


def _attention(
    d: Dims, i: int, q_mult: int = 1, qk_norm: bool = True, bias: bool = False
) -> Tensors:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    t: Tensors = [
        (f"blk.{i}.attn_q.weight", (d.embd, q * q_mult)),
        (f"blk.{i}.attn_k.weight", (d.embd, kv)),
        (f"blk.{i}.attn_v.weight", (d.embd, kv)),
        (f"blk.{i}.attn_output.weight", (q, d.embd)),
    ]
    if bias:
        t += [
            (f"blk.{i}.attn_q.bias", (q,)),
            (f"blk.{i}.attn_k.bias", (kv,)),
            (f"blk.{i}.attn_v.bias", (kv,)),
            (f"blk.{i}.attn_output.bias", (d.embd,)),
        ]
    if qk_norm:
        t += [
            (f"blk.{i}.attn_q_norm.weight", (d.head_dim,)),
            (f"blk.{i}.attn_k_norm.weight", (d.head_dim,)),
        ]
    return t


def _ffn(d: Dims, i: int, ff: int | None = None) -> Tensors:
    n = d.ff if ff is None else ff
    return [
        (f"blk.{i}.ffn_gate.weight", (d.embd, n)),
        (f"blk.{i}.ffn_up.weight", (d.embd, n)),
        (f"blk.{i}.ffn_down.weight", (n, d.embd)),
    ]


def _experts(d: Dims, i: int, bias: bool = False) -> Tensors:
    x, f = d.experts, d.expert_ff
    t: Tensors = [
        (f"blk.{i}.ffn_gate_inp.weight", (d.embd, x)),
        (f"blk.{i}.ffn_gate_exps.weight", (d.embd, f, x)),
        (f"blk.{i}.ffn_up_exps.weight", (d.embd, f, x)),
        (f"blk.{i}.ffn_down_exps.weight", (f, d.embd, x)),
    ]
    if bias:
        t += [
            (f"blk.{i}.ffn_gate_inp.bias", (x,)),
            (f"blk.{i}.ffn_gate_exps.bias", (f, x)),
            (f"blk.{i}.ffn_up_exps.bias", (f, x)),
            (f"blk.{i}.ffn_down_exps.bias", (d.embd, x)),
        ]
    return t


def _shared_expert(d: Dims, i: int, gate_inp: bool) -> Tensors:
    f = d.shared_ff
    t: Tensors = [(f"blk.{i}.ffn_gate_inp_shexp.weight", (d.embd,))] if gate_inp else []
    return [
        *t,
        (f"blk.{i}.ffn_gate_shexp.weight", (d.embd, f)),
        (f"blk.{i}.ffn_up_shexp.weight", (d.embd, f)),
        (f"blk.{i}.ffn_down_shexp.weight", (f, d.embd)),
    ]


def _norms(i: int, embd: int, *names: str) -> Tensors:
    return [(f"blk.{i}.{n}.weight", (embd,)) for n in names]


# --- dense and MoE transformers ------------------------------------------------------------


def _qwen3_dims(embd: int, layers: int, vocab: int) -> Dims:
    hd = 64 if embd < 512 else 128
    heads = embd // hd
    return Dims(embd, layers, heads, max(1, heads // 4), hd, _round(3 * embd), vocab)


def _qwen3_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=False)
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "ffn_norm") + _attention(d, i) + _ffn(d, i)
    return t


def _moe_dims(embd: int, layers: int, vocab: int) -> Dims:
    base = _qwen3_dims(embd, layers, vocab)
    tiny = embd < 512
    return replace(
        base,
        experts=8 if tiny else 32,
        experts_used=2 if tiny else 4,
        expert_ff=_round(3 * embd // 8, 64),
        ff=_round(3 * embd // 8, 64),
    )


def _moe_metadata(d: Dims) -> dict[str, Any]:
    return _common(d) | {
        "expert_count": d.experts,
        "expert_used_count": d.experts_used,
        "expert_feed_forward_length": d.expert_ff,
    }


def _qwen3moe_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=False)
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "ffn_norm") + _attention(d, i) + _experts(d, i)
    return t


# --- sliding-window attention --------------------------------------------------------------


def _gemma3_dims(embd: int, layers: int, vocab: int) -> Dims:
    hd = 64 if embd < 512 else 256
    heads = max(1, embd // hd)
    window = 128 if embd < 512 else 1024
    return Dims(embd, layers, heads, max(1, heads // 2), hd, _round(4 * embd), vocab, window=window)


def _gemma3_metadata(d: Dims) -> dict[str, Any]:
    return _common(d) | {
        "attention.sliding_window": d.window,
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 10_000.0,
    }


def _gemma3_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=True)
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
        t += _attention(d, i) + _ffn(d, i)
    return t


def _gpt_oss_dims(embd: int, layers: int, vocab: int) -> Dims:
    heads = embd // 64
    tiny = embd < 512
    return Dims(
        embd,
        layers,
        heads,
        max(1, heads // 8),
        64,
        embd,
        vocab,
        window=128,
        experts=8 if tiny else 32,
        experts_used=2 if tiny else 4,
        expert_ff=embd,
    )


def _gpt_oss_metadata(d: Dims) -> dict[str, Any]:
    return _moe_metadata(d) | {
        "attention.sliding_window": d.window,
        "rope.dimension_count": d.head_dim,
        "rope.freq_base": 150_000.0,
    }


def _gpt_oss_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=False)
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "post_attention_norm")
        t += _attention(d, i, qk_norm=False, bias=True)
        t += [(f"blk.{i}.attn_sinks.weight", (d.heads,))]
        t += _experts(d, i, bias=True)
    return t


# --- multi-head latent attention (MLA) -----------------------------------------------------

MLA_ROPE, MLA_NOPE, MLA_V = 64, 128, 128  # DeepSeek-V2/V3's head: rotated, plain, value


def _deepseek2_dims(embd: int, layers: int, vocab: int) -> Dims:
    tiny = embd < 512
    if layers in (26, 27):  # llama.cpp reads these depths as V2-Lite, which has no query LoRA
        layers += 2
    # One key-value head: the latent is shared by every head (llama.cpp's MLA layout).
    return Dims(
        embd,
        layers,
        max(1, embd // 128),
        1,
        MLA_NOPE + MLA_ROPE,
        _round(3 * embd),
        vocab,
        experts=8 if tiny else 32,
        experts_used=2 if tiny else 4,
        expert_ff=_round(embd // 2, 64),
        shared_ff=_round(embd // 2, 64),
        lora_q=128 if tiny else 768,
        lora_kv=512,
    )


def _deepseek2_metadata(d: Dims) -> dict[str, Any]:
    return _moe_metadata(d) | {
        "attention.key_length": d.lora_kv + MLA_ROPE,
        "attention.value_length": d.lora_kv,
        "attention.key_length_mla": MLA_NOPE + MLA_ROPE,
        "attention.value_length_mla": MLA_V,
        "attention.q_lora_rank": d.lora_q,
        "attention.kv_lora_rank": d.lora_kv,
        "rope.dimension_count": MLA_ROPE,
        "leading_dense_block_count": 1,
        "expert_shared_count": 1,
        "expert_gating_func": 2,  # sigmoid, as DeepSeek-V3
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
    }


def _deepseek2_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=False)
    h, qr, kvr = d.heads, d.lora_q, d.lora_kv
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "ffn_norm")
        t += [
            (f"blk.{i}.attn_q_a_norm.weight", (qr,)),
            (f"blk.{i}.attn_kv_a_norm.weight", (kvr,)),
            (f"blk.{i}.attn_q_a.weight", (d.embd, qr)),
            (f"blk.{i}.attn_q_b.weight", (qr, h * (MLA_NOPE + MLA_ROPE))),
            (f"blk.{i}.attn_kv_a_mqa.weight", (d.embd, kvr + MLA_ROPE)),
            (f"blk.{i}.attn_k_b.weight", (MLA_NOPE, kvr, h)),
            (f"blk.{i}.attn_v_b.weight", (kvr, MLA_V, h)),
            (f"blk.{i}.attn_output.weight", (h * MLA_V, d.embd)),
        ]
        if i == 0:  # the leading dense block
            t += _ffn(d, i)
        else:
            t += [*_experts(d, i), (f"blk.{i}.exp_probs_b.bias", (d.experts,))]
            t += _shared_expert(d, i, gate_inp=False)
    return t


# --- hybrids: Gated DeltaNet (Qwen3.5) and Mamba-2 (Granite 4.0-H) -------------------------

QWEN35_EVERY = 4  # one full-attention layer in four, as Qwen3.5 and Qwen3-Next


def _qwen35_dims(embd: int, layers: int, vocab: int) -> Dims:
    tiny = embd < 512
    hd = 64 if tiny else 256
    heads = max(1, embd // hd)
    return Dims(
        embd,
        layers,
        heads,
        max(1, heads // 4),
        hd,
        _round(3 * embd),
        vocab,
        ssm_state=128,
        ssm_groups=1 if tiny else embd // 256,
        ssm_heads=2 if tiny else embd // 128,
    )


def _qwen35moe_dims(embd: int, layers: int, vocab: int) -> Dims:
    tiny = embd < 512
    return replace(
        _qwen35_dims(embd, layers, vocab),
        experts=8 if tiny else 32,
        experts_used=2 if tiny else 4,
        expert_ff=_round(embd // 4, 64),
        shared_ff=_round(embd // 4, 64),
    )


def _qwen35_metadata(d: Dims) -> dict[str, Any]:
    rot = d.head_dim // 4  # partial rotary, as Qwen3.5
    half = rot // 2
    third = half // 3
    meta = _common(d) | {
        "rope.dimension_count": rot,
        "rope.dimension_sections": [half - 2 * third, third, third, 0],
        "full_attention_interval": QWEN35_EVERY,
        "ssm.conv_kernel": 4,
        "ssm.state_size": d.ssm_state,
        "ssm.group_count": d.ssm_groups,
        "ssm.time_step_rank": d.ssm_heads,
        "ssm.inner_size": d.ssm_state * d.ssm_heads,
    }
    if d.experts:
        meta |= _moe_metadata(d) | {"expert_shared_feed_forward_length": d.shared_ff}
        meta["rope.freq_base"] = 10_000_000.0
    return meta


def _qwen35_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=False)
    key, value = d.ssm_state * d.ssm_groups, d.ssm_state * d.ssm_heads
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "post_attention_norm")
        if (i + 1) % QWEN35_EVERY == 0:
            t += _attention(d, i, q_mult=2)  # the query carries its output gate
        else:
            t += [
                (f"blk.{i}.attn_qkv.weight", (d.embd, 2 * key + value)),
                (f"blk.{i}.attn_gate.weight", (d.embd, value)),
                (f"blk.{i}.ssm_conv1d.weight", (4, 2 * key + value)),
                (f"blk.{i}.ssm_dt.bias", (d.ssm_heads,)),
                (f"blk.{i}.ssm_a", (d.ssm_heads,)),
                (f"blk.{i}.ssm_beta.weight", (d.embd, d.ssm_heads)),
                (f"blk.{i}.ssm_alpha.weight", (d.embd, d.ssm_heads)),
                (f"blk.{i}.ssm_norm.weight", (d.ssm_state,)),
                (f"blk.{i}.ssm_out.weight", (value, d.embd)),
            ]
        t += _experts(d, i) + _shared_expert(d, i, gate_inp=True) if d.experts else _ffn(d, i)
    return t


GRANITE_EVERY = 6  # attention in one layer of six (Granite 4.0-H: 4 of 40), the rest Mamba-2


def _granite_attention(i: int) -> bool:
    # From the first layer on: llama.cpp reads the attention heads' size only when layer 0 has
    # heads (with none there, it sizes them 0 and refuses the file).
    return i % GRANITE_EVERY == 0


def _granite_dims(embd: int, layers: int, vocab: int) -> Dims:
    hd = 64 if embd < 512 else 128
    heads = embd // hd
    return Dims(
        embd,
        layers,
        heads,
        max(1, heads // 4),
        hd,
        _round(2 * embd),
        vocab,
        ssm_state=128,
        ssm_groups=1,
        ssm_heads=2 * embd // 64,
    )


def _granite_metadata(d: Dims) -> dict[str, Any]:
    heads = [d.heads if _granite_attention(i) else 0 for i in range(d.layers)]
    kv = [d.kv_heads if _granite_attention(i) else 0 for i in range(d.layers)]
    return _common(d) | {
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "rope.freq_base": 10_000.0,
        "ssm.conv_kernel": 4,
        "ssm.state_size": d.ssm_state,
        "ssm.group_count": d.ssm_groups,
        "ssm.time_step_rank": d.ssm_heads,
        "ssm.inner_size": 2 * d.embd,
    }


def _granite_tensors(d: Dims) -> Tensors:
    t = _ends(d, tied=True)
    inner, g, s, h = 2 * d.embd, d.ssm_groups, d.ssm_state, d.ssm_heads
    conv = inner + 2 * g * s
    for i in range(d.layers):
        t += _norms(i, d.embd, "attn_norm", "ffn_norm")
        if _granite_attention(i):
            t += _attention(d, i, qk_norm=False)
        else:
            t += [
                (f"blk.{i}.ssm_in.weight", (d.embd, 2 * inner + 2 * g * s + h)),
                (f"blk.{i}.ssm_conv1d.weight", (4, conv)),
                (f"blk.{i}.ssm_conv1d.bias", (conv,)),
                (f"blk.{i}.ssm_dt.bias", (h,)),
                (f"blk.{i}.ssm_a", (1, h)),
                (f"blk.{i}.ssm_d", (1, h)),
                (f"blk.{i}.ssm_norm.weight", (inner // g, g)),
                (f"blk.{i}.ssm_out.weight", (inner, d.embd)),
            ]
        t += _ffn(d, i)
    return t


def _round(n: int, to: int = 256) -> int:
    return max(to, (n + to // 2) // to * to)


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("qwen3", "dense", _qwen3_dims, _common, _qwen3_tensors, 151936),
        Arch("qwen3moe", "mixture of experts", _moe_dims, _moe_metadata, _qwen3moe_tensors, 151936),
        Arch(
            "gemma3",
            "sliding-window attention",
            _gemma3_dims,
            _gemma3_metadata,
            _gemma3_tensors,
            262144,
            tied=True,
        ),
        Arch(
            "gpt-oss",
            "mixture of experts, sliding-window attention, sinks",
            _gpt_oss_dims,
            _gpt_oss_metadata,
            _gpt_oss_tensors,
            201088,
        ),
        Arch(
            "deepseek2",
            "multi-head latent attention (MLA), mixture of experts",
            _deepseek2_dims,
            _deepseek2_metadata,
            _deepseek2_tensors,
            129280,
        ),
        Arch(
            "qwen35",
            "hybrid: Gated DeltaNet and attention",
            _qwen35_dims,
            _qwen35_metadata,
            _qwen35_tensors,
            248320,
        ),
        Arch(
            "qwen35moe",
            "hybrid: Gated DeltaNet and attention, mixture of experts",
            _qwen35moe_dims,
            _qwen35_metadata,
            _qwen35_tensors,
            248320,
        ),
        Arch(
            "granitehybrid",
            "hybrid: Mamba-2 and attention",
            _granite_dims,
            _granite_metadata,
            _granite_tensors,
            100352,
            tied=True,
        ),
    )
}
