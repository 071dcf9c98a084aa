"""Paged attention over a flat token batch, and the metadata that describes the batch.

Three backends behind one interface:
- `NativeCPUAttention`: the compiled kernel in kernels/paged_attention.cpp, reading K/V straight
  from the paged cache (no gather copy). Default on CPU.
- `TritonAttention` (triton_attention.py): a Triton kernel reading K/V through the block table
  in place. Default on CUDA.
- `TorchAttention` (torch_attention.py): portable torch (gather the blocks, then batched
  scaled_dot_product_attention). Used where neither kernel can run.

The cache layout is [num_blocks, num_kv_heads, block_size, head_dim] per layer (K and V each).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch

from .errors import ConfigError

from .torch_attention import TorchAttention, reference_attention  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Sequences in batch order; sequence i owns tokens [query_start[i], query_start[i+1])."""

    query_start: torch.Tensor      # int32 [B + 1]
    seq_lens: torch.Tensor         # int32 [B]: cached + new tokens after this step
    block_tables: torch.Tensor     # int32 [B, max_blocks]
    slot_blocks: torch.Tensor      # int64 [T]: block of each new token's KV
    slot_offsets: torch.Tensor     # int64 [T]: offset inside that block
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # what a backend works out once per step and reuses in every layer (torch_attention.plan)
    backend_plan: Optional[object] = field(default=None, repr=False, compare=False)
    # KV layer groups (kv_groups.py): the metadata of groups 1.. (this one is group 0's), the
    # same batch over each group's block tables; () with one table per sequence
    groups: tuple = field(default=(), repr=False, compare=False)
    # LoRA adapters (model/lora.py): the step's token groups per adapter; None: no adapter
    lora: Optional[object] = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def with_groups(self, block_tables: torch.Tensor, slot_blocks: torch.Tensor) -> None:
        """Attaches groups 1..'s metadata: block_tables [groups, B, width], slot_blocks
        [groups, T]. The backends see one table per call: a layer is given its group's."""
        self.groups = tuple(
            AttentionMetadata(self.query_start, self.seq_lens, tables, slots, self.slot_offsets,
                              self.query_lens_cpu, self.seq_lens_cpu)
            for tables, slots in zip(block_tables, slot_blocks))

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device,
              group_tables: Sequence[list[list[int]]] = ()) -> "AttentionMetadata":
        """From plain lists (one Python pass, then one tensor per field). group_tables: the
        tables of groups 1.. ([group][sequence]), with KV layer groups."""
        lists = metadata_lists(query_lens, seq_lens, block_tables, block_size, group_tables)
        meta = cls(**{name: torch.tensor(lists[name], dtype=dtype, device=device)
                      for name, dtype in METADATA_DTYPES.items()},
                   query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
        if group_tables:
            meta.with_groups(*(torch.tensor(lists[name], dtype=dtype, device=device)
                               for name, dtype in GROUP_DTYPES.items()))
        return meta


# the tensor fields of AttentionMetadata and their dtypes
METADATA_DTYPES = {"query_start": torch.int32, "seq_lens": torch.int32,
                   "block_tables": torch.int32, "slot_blocks": torch.int64,
                   "slot_offsets": torch.int64}
# ... and those of the groups after the first (KV layer groups), [groups, ...] each
GROUP_DTYPES = {"group_block_tables": torch.int32, "group_slot_blocks": torch.int64}


def metadata_lists(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                   block_size: int,
                   group_tables: Sequence[list[list[int]]] = ()) -> dict[str, list]:
    """AttentionMetadata's fields as plain lists (block tables padded to the widest); with
    group_tables (KV layer groups: [group][sequence], each as long as block_tables' row) also
    GROUP_DTYPES' fields, nested by group."""
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    width = max((len(t) for t in block_tables), default=1) or 1
    slot_blocks, slot_offsets = [], []
    for table, q_len, s_len in zip(block_tables, query_lens, seq_lens):
        for pos in range(s_len - q_len, s_len):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
    lists = {"query_start": starts, "seq_lens": list(seq_lens),
             "block_tables": [t + [0] * (width - len(t)) for t in block_tables],
             "slot_blocks": slot_blocks, "slot_offsets": slot_offsets}
    if group_tables:
        lists["group_block_tables"] = [[t + [0] * (width - len(t)) for t in tables]
                                       for tables in group_tables]
        lists["group_slot_blocks"] = [
            [table[pos // block_size] for table, q_len, s_len in zip(tables, query_lens, seq_lens)
             for pos in range(s_len - q_len, s_len)] for tables in group_tables]
    return lists


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, meta: AttentionMetadata) -> None: ...

    def attend(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int = 0,
               softcap: float = 0.0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`window` > 0: each query sees only its last `window` keys (a sliding-window layer);
        `softcap` > 0: scores -> softcap * tanh(scores / softcap) before the softmax; `sinks`
        [heads] (GPT-OSS): each head's sink logit joins the softmax's denominator (a layer
        without sinks passes none and takes the backend's plain path)."""


class NativeCPUAttention:
    name = "native"

    @staticmethod
    def write_kv(key_cache, value_cache, k, v, meta: AttentionMetadata) -> None:
        torch.ops.batchinfer.write_kv(k, v, key_cache, value_cache, meta.slot_blocks, meta.slot_offsets)

    def attend(self, q, key_cache, value_cache, meta: AttentionMetadata, scale: float,
               window: int = 0, softcap: float = 0.0, sinks: Optional[torch.Tensor] = None):
        if sinks is None:
            return torch.ops.batchinfer.paged_attention(q, key_cache, value_cache,
                                                        meta.block_tables, meta.query_start,
                                                        meta.seq_lens, scale, window, softcap)
        return torch.ops.batchinfer.paged_attention(q, key_cache, value_cache, meta.block_tables,
                                                    meta.query_start, meta.seq_lens, scale,
                                                    window, softcap, sinks.float())


def fused_ops_for(backend_name: str):
    """The model's element-wise ops that go with an attention backend: the CPU's fused kernels
    with native, the Triton ones with triton; None keeps TorchOps."""
    if backend_name == "native":
        from .model.ops import NativeOps

        return NativeOps
    if backend_name == "triton":
        from .triton_ops import TritonOps

        return TritonOps
    return None


def triton_available() -> str:
    """'' when the Triton kernel can run here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return ""


def check_backend_choice(choice: str, device_type: str,
                         dtype: Optional[torch.dtype] = None) -> None:
    """device.attention_backend asked for where it cannot run: a ConfigError (`batchinfer
    validate` calls this with the recipe's dtype, None while it is auto)."""
    if choice == "triton" and device_type != "cuda":
        raise ConfigError(f"device.attention_backend: triton needs device cuda (this engine runs "
                          f"on {device_type}); on CPU use native or torch, or auto")
    if choice == "native" and (device_type != "cpu" or dtype not in (None, torch.float32,
                                                                     torch.bfloat16)):
        what = f"device {device_type}" if device_type != "cpu" else f"dtype {dtype}"
        raise ConfigError(f"device.attention_backend: native needs device cpu and dtype float32 "
                          f"or bfloat16 (got {what}); use triton or torch on CUDA, or auto")


def select_backend(choice: str, device: torch.device, dtype: torch.dtype, arch=None,
                   kv_dtype: Optional[torch.dtype] = None) -> AttentionBackend:
    """auto: on CPU the native kernel with fp32 activations (dtype float32, or bfloat16: bf16
    weights, fp32 activations) when it builds, else torch; on CUDA the Triton paged kernel when
    triton imports and takes the model (`arch`'s heads, the dtypes), else torch with one warning
    that says why (for `triton` asked explicitly too)."""
    from .kernels import load_native_kernels

    check_backend_choice(choice, device.type, dtype)
    if choice in ("triton", "auto") and device.type == "cuda":
        missing = triton_available()
        if not missing and arch is not None:
            from .triton_attention import unsupported_reason

            missing = unsupported_reason(arch.head_dim, arch.num_heads,
                                         arch.num_kv_heads, dtype, kv_dtype or dtype)
        if not missing:
            from .triton_attention import TritonAttention

            return TritonAttention()
        log.warning("the Triton attention can't run (%s): CUDA attention takes the portable "
                    "torch path", missing)
    native_ok = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if choice in ("native", "auto") and native_ok and load_native_kernels():
        return NativeCPUAttention()
    if choice == "native":
        raise RuntimeError("the native attention kernel could not be built (see the warning above)")
    return TorchAttention()
