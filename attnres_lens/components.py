"""Transformer components, one small class each, with TransformerLens hook names (docs/hooks.md)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from attnres_lens.config import ModelConfig
from attnres_lens.hook_checks import any_hooked, is_hooked, module_hooked
from attnres_lens.kernels import causal_attention, kv_shift, rms_norm, rotary


def normal_init(
    shape: tuple[int, ...], std: float, divisor: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """`torch.randn(shape) * std / divisor`, the same values, with in-place products; drawn from `generator` (on its
    device) when given, else from torch's global generator. On the meta device (a model built to read its parameter
    shapes before loading a checkpoint) an empty tensor of the shape: a meta `randn` and out-of-place products run
    Python decompositions that import torch._dynamo and sympy, seconds added to every command that loads a run."""
    if torch.empty(0).is_meta:
        return torch.empty(shape)
    if generator is not None:
        return torch.randn(shape, generator=generator, device=generator.device).mul_(std).div_(divisor)
    weight = torch.randn(shape).mul_(std)
    return weight if divisor == 1.0 else weight.div_(divisor)


def side_generator() -> torch.Generator | None:
    """A CPU generator seeded from the global generator's next draw, without advancing it (None on the meta device).
    Parameters only some models have (mHC's) draw from it, so the parameters every residual kind shares take the
    same draws from the global stream for one seed, whatever the residual (docs/model.md §6)."""
    if torch.empty(0).is_meta:
        return None
    with torch.random.fork_rng(devices=[]):
        seed = int(torch.randint(2**62, (), device="cpu"))
    return torch.Generator().manual_seed(seed)


class RMSNorm(nn.Module):
    """`x / rms(x) * w`, with gain `w` (init 1). Hooks `hook_scale` [..., 1] and `hook_normalized`."""

    def __init__(self, d_model: int, eps: float, hooked: bool = True, backend: str = "auto"):
        super().__init__()
        self.eps = eps
        self.backend = backend  # the model's depth-attention backend: its C kernels include this norm
        self.w = nn.Parameter(torch.ones(d_model))
        # Depth-attention key norms run once per source per sublayer; hooks there would be noise.
        self.hooked = hooked
        if hooked:
            self.hook_scale = HookPoint()
            self.hook_normalized = HookPoint()

    # hook points whose hooks make the norm compute its scale explicitly, and keep it out of a depth mix's kernel
    path_hooks = ("hook_scale", "hook_normalized")

    def observed(self) -> bool:
        """Whether a hook watches the scale or the normalised output (then both are computed explicitly)."""
        return self.hooked and any_hooked(self, self.path_hooks)

    def watched(self) -> bool:
        """`observed()`, or a PyTorch hook on this norm's call: then a depth mix does not compute the norm inside
        its own kernel."""
        return self.observed() or module_hooked(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.observed():  # nothing watches the scale: the fused op (docs/kernels.md §2)
            return rms_norm(x, self.w, self.eps, self.backend)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w)


class Embed(nn.Module):
    """Token embedding `W_E` [d_vocab, d_model], under TransformerLens's name and layout so its utilities read it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_E = nn.Parameter(normal_init((cfg.d_vocab, cfg.d_model), cfg.init_range))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    """Learned absolute positions (`positional_embedding_type="standard"`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.W_pos = nn.Parameter(normal_init((cfg.n_ctx, cfg.d_model), cfg.init_range))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.W_pos[: tokens.shape[-1]].expand(tokens.shape[0], -1, -1)


class Unembed(nn.Module):
    """`x @ W_U (+ b_U)`. Tied (`tie_word_embeddings`): `W_U` is the token embedding's `W_E` transposed, no
    parameter of its own; `embed` is then that embedding."""

    def __init__(self, cfg: ModelConfig, embed: Embed | None = None):
        super().__init__()
        if cfg.tie_word_embeddings:
            if embed is None:
                raise ValueError("a tied unembedding (tie_word_embeddings=True) needs the model's token embedding")
            # a plain attribute in a tuple, not a submodule: W_E stays one parameter under one name (embed.W_E)
            self._tied = (embed,)
        else:
            self.W_U = nn.Parameter(normal_init((cfg.d_model, cfg.d_vocab), cfg.init_range))
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab)) if cfg.use_bias else None

    def __getattr__(self, name: str) -> Any:
        if name == "W_U" and "_tied" in self.__dict__:
            return self.__dict__["_tied"][0].W_E.T
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x @ self.W_U
        return logits if self.b_U is None else logits + self.b_U


class Attention(nn.Module):
    """Causal multi-head attention, standard or KV-shifting (docs/model.md §5), with RoPE and GQA.

    KV shift: per key/value head, `K̂_t = α1·K_t + α2·K_{t−1}` and `V̂_t = β1·V_t + β2·V_{t−1}`
    (zeros before t = 0), stored as `kv_shift[head] = (α1, α2, β1, β2)`; RoPE is applied to K̂ (by the shift's
    own C pass on the cpu backend, unless a hook watches `hook_k_shifted`).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        n_kv = cfg.n_key_value_heads
        std = cfg.init_range
        self.W_Q = nn.Parameter(normal_init((cfg.n_heads, cfg.d_model, cfg.d_head), std))
        self.W_K = nn.Parameter(normal_init((n_kv, cfg.d_model, cfg.d_head), std))
        self.W_V = nn.Parameter(normal_init((n_kv, cfg.d_model, cfg.d_head), std))
        # Output projections write into the residual: scaled down with depth as in GPT-2.
        self.W_O = nn.Parameter(normal_init((cfg.n_heads, cfg.d_head, cfg.d_model), std, math.sqrt(2 * cfg.n_layers)))
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        if cfg.attention == "kv_shift":
            # [α1, 1 − α1, β1, 1 − β1] per head, filled in place; left empty on the meta device (see normal_init)
            shift = torch.empty(n_kv, 4)
            if not shift.is_meta:
                alpha1, beta1 = torch.rand(n_kv), torch.rand(n_kv)
                shift[:, 0], shift[:, 2] = alpha1, beta1
                shift[:, 1].fill_(1).sub_(alpha1)
                shift[:, 3].fill_(1).sub_(beta1)
            self.kv_shift = nn.Parameter(shift)
            self.hook_k_shifted = HookPoint()
            self.hook_v_shifted = HookPoint()
        if cfg.positional_embedding_type == "rotary":
            cos, sin = rotary_tables(cfg.n_ctx, cfg.d_head, cfg.rotary_base)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_pos = x.shape[1]
        q = self.hook_q(_project_heads(x, self.W_Q))
        k = self.hook_k(_project_heads(x, self.W_K))
        v = self.hook_v(_project_heads(x, self.W_V))
        rope = self.cfg.positional_embedding_type == "rotary"
        cos, sin = (self.rotary_cos, self.rotary_sin) if rope else (None, None)
        backend = self.cfg.depth_attention_backend  # the model's: its C kernels include these ops
        k_rotated = False  # K's rotary embedding applied already, in the KV shift's pass
        if self.cfg.attention == "kv_shift":
            # the shift may rotate K too where no hook reads K̂ before it is rotated (the hook point is then the
            # identity)
            tables = (cos, sin) if rope and not is_hooked(self.hook_k_shifted) else None
            k, v, k_rotated = kv_shift(k, v, self.kv_shift, backend, tables)
            k, v = (k if k_rotated else self.hook_k_shifted(k)), self.hook_v_shifted(v)
        if rope:
            q = self.hook_rot_q(rotary(q, cos, sin, backend))
            k = self.hook_rot_k(k if k_rotated else rotary(k, cos, sin, backend))
        group = self.cfg.n_heads // self.cfg.n_key_value_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        if self.observed():
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.cfg.d_head)
            # built per call at the sequence's length: an [n_ctx, n_ctx] buffer per layer costs gigabytes at the
            # context lengths of imported models (8192² bytes × 32 layers), and is as large as the scores it masks
            future = torch.ones(n_pos, n_pos, dtype=torch.bool, device=scores.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
            pattern = self.hook_pattern(self.hook_attn_scores(scores).softmax(dim=-1))
            z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        else:  # nothing watches the scores: a fused op computes the same softmax without materialising it
            z = causal_attention(q, k, v, 1 / math.sqrt(self.cfg.d_head), backend)
        z = self.hook_z(z)
        return z.flatten(-2) @ self.W_O.flatten(0, 1)

    # hook points whose hooks make the attention compute its scores explicitly (interventions stack copies by them)
    path_hooks = ("hook_attn_scores", "hook_pattern")

    def observed(self) -> bool:
        """Whether a hook watches the attention scores or pattern (then they are computed explicitly)."""
        return any_hooked(self, self.path_hooks)


def _project_heads(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`einsum("bpm,hmd->bphd", x, weight)` as one matmul whose output is already in [batch, pos, heads, d_head]
    order (einsum's would be permuted, then copied)."""
    n_heads, d_model, d_head = weight.shape
    return (x @ weight.transpose(0, 1).reshape(d_model, n_heads * d_head)).unflatten(-1, (n_heads, d_head))


class MLP(nn.Module):
    """`act(x W_in + b_in) W_out + b_out`, or gated (`gated_mlp`, TransformerLens's gated-MLP names):
    `(act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out`, which with `act_fn="silu"` is SwiGLU.
    Biases exist only with `use_bias`. Hooks: `hook_pre` (the activation's input: the gate when gated),
    `hook_pre_linear` (gated only: the linear branch) and `hook_post` (the input of W_out)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        std = cfg.init_range
        self.gated = cfg.gated_mlp
        if cfg.gated_mlp:
            self.W_gate = nn.Parameter(normal_init((cfg.d_model, cfg.d_mlp), std))
            self.b_gate = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.use_bias else None
            self.hook_pre_linear = HookPoint()
        self.W_in = nn.Parameter(normal_init((cfg.d_model, cfg.d_mlp), std))
        self.b_in = nn.Parameter(torch.zeros(cfg.d_mlp)) if cfg.use_bias else None
        self.W_out = nn.Parameter(normal_init((cfg.d_mlp, cfg.d_model), std, math.sqrt(2 * cfg.n_layers)))
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.use_bias else None
        self.act_fn = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[cfg.act_fn]
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate = self.hook_pre(_affine(x, self.W_gate, self.b_gate))
            post = self.hook_post(self.act_fn(gate) * self.hook_pre_linear(_affine(x, self.W_in, self.b_in)))
        else:
            post = self.hook_post(self.act_fn(self.hook_pre(_affine(x, self.W_in, self.b_in))))
        return _affine(post, self.W_out, self.b_out)


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight + bias`, the bias added inside the matmul (one pass over the output instead of two). Under
    autocast the sum keeps its own form: there a linear would round the fp32 bias and the output to the autocast
    dtype."""
    if bias is None:
        return x @ weight
    if torch.is_autocast_enabled(x.device.type):
        return x @ weight + bias
    return F.linear(x, weight.t(), bias)


def shift_one_position(x: torch.Tensor) -> torch.Tensor:
    """`x[:, t-1]` at position t, zeros at t = 0 (x is [batch, pos, ...]); one pad, not zeros and a concatenation."""
    return F.pad(x[:, :-1], (0, 0) * (x.ndim - 2) + (1, 0))


def rotary_tables(n_ctx: int, d_head: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [n_ctx, d_head] for rotate-half RoPE (GPT-NeoX layout). On the meta device (a model built
    for its shapes) they are empty tables of that shape: nothing is allocated, and arange there would import
    torch._dynamo."""
    if torch.empty(0).is_meta:
        return torch.empty(n_ctx, d_head), torch.empty(n_ctx, d_head)
    inv_freq = 1.0 / base ** (torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angles = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()
