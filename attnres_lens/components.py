"""Transformer components, one small class each, with TransformerLens hook names (docs/hooks.md)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module  # its global hooks (register_module_*_hook)
from transformer_lens.hook_points import HookPoint

from attnres_lens.config import ModelConfig
from attnres_lens.kernels.backends import attention_runs_cpu_kernel, elementwise_runs_cpu_kernel
from attnres_lens.kernels.cpu_attention import causal_attention_cpu
from attnres_lens.kernels.cpu_elementwise import kv_shift_cpu, rms_norm_cpu, rotary_cpu


def normal_init(shape: tuple[int, ...], std: float, divisor: float = 1.0) -> torch.Tensor:
    """`torch.randn(shape) * std / divisor`, the same values, with in-place products. On the meta device (a model
    built to read its parameter shapes before loading a checkpoint) an empty tensor of the shape: a meta `randn`
    and out-of-place products run Python decompositions that import torch._dynamo and sympy, seconds added to
    every command that loads a run."""
    if torch.empty(0).is_meta:
        return torch.empty(shape)
    weight = torch.randn(shape).mul_(std)
    return weight if divisor == 1.0 else weight.div_(divisor)


def is_hooked(point: HookPoint) -> bool:
    """`point.has_hooks()` with its defaults (any forward or backward hook, permanent ones included), without
    the closures that builds per call: asked several times per sublayer on every forward (docs/kernels.md §11)."""
    return bool(point.fwd_hooks or point.bwd_hooks)


def any_hooked(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether any of `module`'s hook points `names` `is_hooked`, read from its submodules directly: nn.Module's
    attribute fallback is slow for a question each sublayer asks several times per forward (docs/kernels.md §11)."""
    points = module._modules
    for name in names:  # a loop, not any(generator): asked for every consumer of every step
        point = points[name]
        if point.fwd_hooks or point.bwd_hooks:  # is_hooked, inlined
            return True
    return False


def parameter(module: nn.Module, name: str) -> torch.Tensor:
    """`getattr(module, name)` for a parameter, read from `module._parameters` where it is a plain one: nn.Module's
    attribute fallback is slow, and each depth-mix consumer reads three per forward (docs/kernels.md §11). A
    parametrized parameter (`torch.nn.utils.parametrize`) is not there, and is computed as usual."""
    value = module._parameters.get(name)
    return value if value is not None else getattr(module, name)


def module_hooked(module: nn.Module) -> bool:
    """Whether a PyTorch hook would see a call of `module`: one of its own (TransformerLens's hooks on a hook point
    are such hooks) or a global module hook. A fused path that skips the call must not run then."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or torch_module._global_forward_hooks
                or torch_module._global_forward_pre_hooks or torch_module._global_backward_hooks
                or torch_module._global_backward_pre_hooks)


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
        if not self.observed():
            # nothing watches the scale: one C pass each way on the cpu backend, else PyTorch's fused norm (one
            # pass instead of several on CUDA); docs/kernels.md §2
            if elementwise_runs_cpu_kernel(self.backend, x) and self.w.dtype == x.dtype:
                return rms_norm_cpu(x, self.w, self.eps)
            return F.rms_norm(x, x.shape[-1:], self.w, self.eps)
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w)


def norm_fuses_into(norm: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a C depth mix of `dtype` may compute `norm` inside its kernel: it is the model's `RMSNorm` (a module
    a user put in its place runs on its own), nothing watches it, and its gain has the mix's dtype (docs/kernels.md
    §4)."""
    return isinstance(norm, RMSNorm) and not norm.watched() and parameter(norm, "w").dtype == dtype


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

    def __init__(self, cfg: ModelConfig, embed: Optional[Embed] = None):
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
        rotary = self.cfg.positional_embedding_type == "rotary"
        k_rotated = False  # K's rotary embedding applied already, in the KV shift's pass
        if self.cfg.attention == "kv_shift":
            if elementwise_runs_cpu_kernel(self.cfg.depth_attention_backend, k, v):  # both in one fused op
                # with K's rotary too where no hook reads K̂ before it is rotated (the hook point is then the identity)
                k_rotated = rotary and not is_hooked(self.hook_k_shifted)
                k, v = kv_shift_cpu(k, v, self.kv_shift, (self.rotary_cos, self.rotary_sin) if k_rotated else None)
            else:
                k, v = TokenShiftMix.apply(k, self.kv_shift[:, :2]), TokenShiftMix.apply(v, self.kv_shift[:, 2:])
            k, v = (k if k_rotated else self.hook_k_shifted(k)), self.hook_v_shifted(v)
        if rotary:
            q, k = self.hook_rot_q(self._rotate(q)), self.hook_rot_k(k if k_rotated else self._rotate(k))
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
        elif attention_runs_cpu_kernel(self.cfg.depth_attention_backend, q, k, v):  # no gradient: one C pass
            z = causal_attention_cpu(q, k, v, 1 / math.sqrt(self.cfg.d_head))
        else:  # nothing watches the scores: the fused kernel computes the same softmax without materialising it
            z = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, scale=1 / math.sqrt(self.cfg.d_head)).transpose(1, 2)
        z = self.hook_z(z)
        return z.flatten(-2) @ self.W_O.flatten(0, 1)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE of q or k [batch, pos, heads, d_head]: one C pass where the cpu backend runs, else the torch form."""
        if elementwise_runs_cpu_kernel(self.cfg.depth_attention_backend, x):
            return rotary_cpu(x, self.rotary_cos, self.rotary_sin)
        n_pos = x.shape[1]
        return apply_rotary(x, self.rotary_cos[:n_pos, None, :], self.rotary_sin[:n_pos, None, :])

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


def _affine(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """`x @ weight + bias`, the bias added inside the matmul (one pass over the output instead of two). Under
    autocast the sum keeps its own form: there a linear would round the fp32 bias and the output to the autocast
    dtype."""
    if bias is None:
        return x @ weight
    if torch.is_autocast_enabled(x.device.type):
        return x @ weight + bias
    return F.linear(x, weight.t(), bias)


class TokenShiftMix(torch.autograd.Function):
    """`c1 ⊙ x_t + c2 ⊙ x_{t−1}` per head (x_{−1} = 0), x [batch, pos, heads, d_head], coefficients [heads, 2]:
    the KV shift (docs/model.md §5) in two ops each way, where autograd's graph of mul, pad and add takes about ten
    memory-bound passes per tensor.

    Backward (dy the output gradient, sums over batch, position and d_head):
        dx_t = c1 dy_t + c2 dy_{t+1} (dy_P = 0),   dc1 = Σ dy_t · x_t,   dc2 = Σ dy_t · x_{t−1}
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        current, previous = coefficients.to(x.dtype).unbind(-1)
        y = x * current[:, None]
        y[:, 1:].addcmul_(x[:, :-1], previous[:, None])
        ctx.save_for_backward(x, coefficients)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, coefficients = ctx.saved_tensors
        current, previous = coefficients.to(x.dtype).unbind(-1)
        dx = dy * current[:, None]
        dx[:, :-1].addcmul_(dy[:, 1:], previous[:, None])
        d_current = (dy * x).sum(dim=(0, 1, 3))
        d_previous = (dy[:, 1:] * x[:, :-1]).sum(dim=(0, 1, 3))
        return dx, torch.stack([d_current, d_previous], dim=-1).to(coefficients.dtype)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` with rotate_half(x) = [−x₂, x₁] for the halves x₁, x₂ of the last dim,
    written as `roll(x) * [−sin₁, sin₂]`: one copy of x instead of a negation and a concatenation."""
    half = x.shape[-1] // 2
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # [pos, 1, d_head]: small
    return torch.addcmul(x * cos, x.roll(half, dims=-1), signed_sin)
