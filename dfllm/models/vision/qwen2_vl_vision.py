"""Qwen2-VL's vision transformer, as transformers' ``Qwen2VisionTransformerPretrainedModel``.

An image arrives as its patches (``(t * h * w, channels * temporal_patch * patch * patch)``, as
the Qwen2-VL image processor flattens them, 2x2 patch blocks adjacent) with its grid
``(t, h, w)``. A 3-D convolution embeds each patch; the blocks (pre-norm attention with a 2-D
rotary embedding of each patch's row and column, and a quick-GELU MLP) attend within each
image (each frame); the merger layer-norms and concatenates each 2x2 block of patches and
projects it to the text model's width: one embedding per ``spatial_merge_size ** 2`` patches.
Several images run as one batch (attention stays within each). Parameter names follow
transformers' (``patch_embed.proj``, ``blocks.N.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}``,
``merger.{ln_q,mlp.0,mlp.2}``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dfllm.models.vision.clip_vision import VisionMLP, vision_activation


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen2VLVisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.head_dim).unbind(1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        dtype = q.dtype
        q = (q.float() * c + _rotate_half(q.float()) * s).to(dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(dtype)
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):  # each image (frame) attends within itself
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            out[a:b] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, act: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Qwen2VLVisionAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = VisionMLP(dim, mlp_hidden, act)

    def forward(self, x, cos, sin, bounds):
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class Qwen2VLPatchMerger(nn.Module):
    def __init__(self, dim: int, context_dim: int, merge: int):
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's vision tower (see the module's docstring); ``config`` is its ``vision_config``
    (an object or a dict)."""

    inv_freq: torch.Tensor  # buffer

    def __init__(self, config):
        super().__init__()
        cfg = config if isinstance(config, dict) else config.to_dict()
        self.embed_dim, heads = cfg["embed_dim"], cfg["num_heads"]
        self.patch_size, self.temporal_patch_size = cfg.get("patch_size", 14), cfg.get("temporal_patch_size", 2)
        self.in_channels = cfg.get("in_channels", 3)
        self.merge = cfg.get("spatial_merge_size", 2)
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            self.in_channels, self.embed_dim, kernel_size=kernel, stride=kernel, bias=False
        )
        mlp_hidden = int(self.embed_dim * cfg.get("mlp_ratio", 4))
        act = cfg.get("hidden_act", "quick_gelu")
        self.blocks = nn.ModuleList(
            Qwen2VLVisionBlock(self.embed_dim, heads, mlp_hidden, act) for _ in range(cfg["depth"])
        )
        self.merger = Qwen2VLPatchMerger(cfg["hidden_size"], self.embed_dim, self.merge)
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = (self.embed_dim // heads) // 2
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial), persistent=False
        )

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Each patch's (row, column), 2x2 merge blocks adjacent, as the processor lays them out."""
        m, out = self.merge, []
        for t, h, w in grids:
            hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hw = torch.stack(
                [hpos.reshape(shape).transpose(1, 2).flatten(), wpos.reshape(shape).transpose(1, 2).flatten()], dim=-1
            )
            out.append(hw.repeat(t, 1))
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """The merged embeddings of the images, concatenated: ``t * h * w / merge**2`` rows each."""
        proj = self.patch_embed.proj
        x = pixel_values.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        x = proj(x.to(proj.weight.dtype)).view(-1, self.embed_dim)
        pos = self._positions(grids).to(x.device)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq.to(x.device)  # (n, 2, spatial / 2)
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        bounds = [0]
        for t, h, w in grids:
            for _ in range(t):
                bounds.append(bounds[-1] + h * w)
        for block in self.blocks:
            x = block(x, cos, sin, bounds)
        return self.merger(x)

    def checkpoint_name(self, name: str) -> str | None:
        return name


# ---- Qwen2.5-VL ------------------------------------------------------------------------------
class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _GatedMLP(nn.Module):
    """SwiGLU with biases; gate and up fused into ``gate_up_proj`` (the loader fills it from
    the checkpoint's ``gate_proj``/``up_proj``, as for the decoders)."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = nn.Linear(dim, 2 * hidden)
        object.__setattr__(self.gate_up_proj, "output_sizes", [hidden, hidden])
        self.down_proj = nn.Linear(hidden, dim)
        self.act = vision_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.hidden, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Qwen25VLVisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, act: str):
        super().__init__()
        self.norm1 = _RMSNorm(dim)
        self.attn = Qwen2VLVisionAttention(dim, heads)
        self.norm2 = _RMSNorm(dim)
        self.mlp = _GatedMLP(dim, mlp_hidden, act)

    def forward(self, x, cos, sin, bounds):
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class Qwen25VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL's vision tower: Qwen2-VL's with RMS norms, a gated MLP, and attention within
    windows of ``window_size`` pixels except in the ``fullatt_block_indexes`` blocks (the patches
    reordered window by window, in 2x2 merge units, and the merged outputs put back in order)."""

    def __init__(self, config):
        nn.Module.__init__(self)
        cfg = config if isinstance(config, dict) else config.to_dict()
        self.embed_dim, heads = cfg["hidden_size"], cfg["num_heads"]
        self.patch_size, self.temporal_patch_size = cfg.get("patch_size", 14), cfg.get("temporal_patch_size", 2)
        self.in_channels = cfg.get("in_channels", 3)
        self.merge = cfg.get("spatial_merge_size", 2)
        self.window_size = cfg.get("window_size", 112)
        self.full_blocks = set(cfg.get("fullatt_block_indexes") or ())
        kernel = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(
            self.in_channels, self.embed_dim, kernel_size=kernel, stride=kernel, bias=False
        )
        act = cfg.get("hidden_act", "silu")
        self.blocks = nn.ModuleList(
            Qwen25VLVisionBlock(self.embed_dim, heads, cfg["intermediate_size"], act) for _ in range(cfg["depth"])
        )
        self.merger = Qwen2VLPatchMerger(cfg["out_hidden_size"], self.embed_dim, self.merge)
        self.merger.ln_q = _RMSNorm(self.embed_dim)
        theta = float((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = (self.embed_dim // heads) // 2
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial), persistent=False
        )

    def _windows(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """The merge units in window order, and the windows' bounds in patches."""
        size = self.window_size // self.merge // self.patch_size  # a window's side, in merge units
        unit = self.merge * self.merge
        order, bounds, base = [], [0], 0
        for t, h, w in grids:
            lh, lw = h // self.merge, w // self.merge
            index = torch.arange(t * lh * lw).reshape(t, lh, lw)
            ph, pw = size - lh % size, size - lw % size
            padded = F.pad(index, (0, pw, 0, ph), "constant", -100)
            nh, nw = (lh + ph) // size, (lw + pw) // size
            padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size * size)
            for window in padded.reshape(-1, size * size):
                kept = window[window != -100]
                if kept.numel():
                    order.append(kept + base)
                    bounds.append(bounds[-1] + kept.numel() * unit)
            base += t * lh * lw
        return torch.cat(order), bounds

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        proj = self.patch_embed.proj
        x = pixel_values.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        x = proj(x.to(proj.weight.dtype)).view(-1, self.embed_dim)
        n, unit = x.shape[0], self.merge * self.merge
        order, window_bounds = self._windows(grids)
        order = order.to(x.device)

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(n // unit, unit, -1)[order].reshape(n, -1)

        pos = self._positions(grids).to(x.device)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq.to(x.device)
        angles = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        angles = permute(torch.cat([angles, angles], dim=-1))
        cos, sin = angles.cos(), angles.sin()
        x = permute(x)
        full = [0]
        for t, h, w in grids:
            for _ in range(t):
                full.append(full[-1] + h * w)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in self.full_blocks else window_bounds)
        return self.merger(x)[torch.argsort(order)]
