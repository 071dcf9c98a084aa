"""Which rank owns each layer's FFN weights, and the order a rank prefetches the others (§4.2).

Layers form consecutive cycles of d (the data-parallel degree). By default layer l belongs to
rank l mod d, so every rank owns one layer per cycle and needs the other d - 1 from their owners:
d - 1 weight slots suffice. Peak shifting: in the cycle starting at layer c, rank r prefetches
from layer c + r and wraps around inside the cycle (skipping what it owns), so at any moment the
ranks tend to read different owners instead of all pulling the same layer from one.
"""
from __future__ import annotations

from typing import Optional


def default_owners(num_layers: int, dp: int) -> list[int]:
    return [layer % dp for layer in range(num_layers)]


def resolve_owners(owners: Optional[list[int]], num_layers: int, dp: int) -> list[int]:
    """The recipe's map (strategy.owners) checked, or the default; ValueError names what is wrong."""
    if owners is None:
        return default_owners(num_layers, dp)
    if len(owners) != num_layers:
        raise ValueError(f"strategy.owners lists {len(owners)} layers; the model has "
                         f"{num_layers}")
    bad = [(layer, r) for layer, r in enumerate(owners) if not 0 <= r < dp]
    if bad:
        layer, r = bad[0]
        raise ValueError(f"strategy.owners[{layer}] = {r}: owners are data-parallel ranks "
                         f"0..{dp - 1}")
    return list(owners)


def prefetch_order(rank: int, owners: list[int], dp: int, peak_shifting: bool = True) -> list[int]:
    """The non-owned layers of one forward pass in the order `rank` fetches them."""
    order: list[int] = []
    num_layers = len(owners)
    for start in range(0, num_layers, dp):
        cycle = list(range(start, min(start + dp, num_layers)))
        shift = rank % len(cycle) if peak_shifting else 0
        order.extend(layer for layer in cycle[shift:] + cycle[:shift] if owners[layer] != rank)
    return order


def weight_slots(rank: int, owners: list[int], dp: int, enabled: bool = True) -> int:
    """The slots a rank allocates: slots_needed, or none when remote layers are read in place."""
    return slots_needed(rank, owners, dp) if enabled else 0


def slots_needed(rank: int, owners: list[int], dp: int) -> int:
    """Most non-owned layers in one cycle: the slots that let a whole cycle be prefetched (d - 1
    with the default map). Fewer could deadlock: slots filled with layers needed later."""
    num_layers = len(owners)
    return max((sum(1 for layer in range(start, min(start + dp, num_layers))
                    if owners[layer] != rank)
                for start in range(0, num_layers, dp)), default=0)
