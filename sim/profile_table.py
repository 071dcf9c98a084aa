"""The profiler's output: what one rank's micro-batch costs on this machine, as a versioned table.

Per thread count of a rank (a PP=2 run on 2 cores gives each rank 1 thread), one decoder layer:

    seconds = dense(tokens) + per_seq_s * sequences
              + attn_decode(decode sequences) * (context tokens read by decode queries)
              + attn_prefill_s * (query x key pairs of prefill chunks)

`dense` is a table over the micro-batch's token count (GEMMs, norms, activations: what does not
depend on context); `attn_decode` a table over the number of decode sequences (a few sequences
keep fewer threads busy in the attention kernel, so a context token costs more); both tables and
the two coefficients are fitted from the measured points, which the table keeps (with the fit's
prediction beside each) so a reader can check the model. The last pipeline
stage adds `lm_head(rows)` and `sampling(rows)` for the rows that sample. Links cost
`latency_s + bytes / bytes_per_s` (p2p between stages; all-reduce of `ranks` ranks, scaled as a
ring for other sizes; host_copy: a copy between device and host memory, Seesaw's KV tier and
weight reloads). The controller's own time per step is `per_step_s + per_seq_s * seqs`.
The model's `ffn_share` (FFN weights over a layer's) splits `dense` for SiDP's FFN-only work.

EXTRAPOLATION (also written into every saved table): tables are piecewise linear through their
points; below the first point they keep its time, above the last they follow the last segment's
slope (never negative); a thread count that was not profiled uses the nearest profiled one below
it (or the smallest), scaled by the thread ratio.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Union

from batchinfer.engine.errors import ConfigError
from batchinfer.engine.step_times import interpolate

FORMAT = "batchinfer-profile"
VERSION = 1
EXTRAPOLATION = ("piecewise linear through the points; below the first point its time, above the "
                 "last the last segment's slope (never negative); an unprofiled thread count uses "
                 "the nearest profiled one below it (else the smallest), times scaled by the "
                 "thread ratio")
Points = list[tuple[int, float]]


def _points(raw) -> Points:
    return sorted((int(x), float(y)) for x, y in raw)


@dataclass
class RankCompute:
    """One rank's costs at one thread count (seconds; layer terms are per decoder layer)."""

    layer_dense: Points
    per_seq_s: float
    attn_decode: Points              # (decode sequences, seconds per context token)
    attn_prefill_s: float
    lm_head: Points
    sampling: Points
    points: list[dict] = field(default_factory=list)   # the measurements the fit came from

    def __post_init__(self) -> None:
        for name in ("layer_dense", "attn_decode", "lm_head", "sampling"):
            table = _points(getattr(self, name))
            if not table or min(x for x, _ in table) < 1 or min(y for _, y in table) < 0:
                raise ValueError(f"{name}: needs points with size >= 1 and seconds >= 0")
            setattr(self, name, table)
        for name in ("per_seq_s", "attn_prefill_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")

    def layer_seconds(self, tokens: int, seqs: int, decode_seqs: int, decode_context: float,
                      prefill_pairs: float) -> float:
        attn = interpolate(self.attn_decode, max(decode_seqs, 1)) if decode_context else 0.0
        return (interpolate(self.layer_dense, max(tokens, 1)) + self.per_seq_s * seqs
                + attn * decode_context + self.attn_prefill_s * prefill_pairs)

    def head_seconds(self, rows: int) -> float:
        """Final norm + LM head + sampler for `rows` sampled rows (0: nothing)."""
        if rows <= 0:
            return 0.0
        return interpolate(self.lm_head, rows) + interpolate(self.sampling, rows)

    def scaled(self, factor: float) -> "RankCompute":
        return RankCompute([(x, y * factor) for x, y in self.layer_dense], self.per_seq_s * factor,
                           [(x, y * factor) for x, y in self.attn_decode],
                           self.attn_prefill_s * factor,
                           [(x, y * factor) for x, y in self.lm_head],
                           [(x, y * factor) for x, y in self.sampling])


@dataclass
class LinkCost:
    latency_s: float
    bytes_per_s: float
    ranks: int = 2

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    def allreduce_seconds(self, nbytes: float, ranks: int) -> float:
        """A ring all-reduce: 2(n-1) steps of n-th sized chunks, from the measured `ranks`."""
        if ranks <= 1:
            return 0.0
        steps, measured_steps = 2 * (ranks - 1), 2 * (self.ranks - 1)
        per_step_latency = self.latency_s / measured_steps
        bus_bytes_per_s = self.bytes_per_s * measured_steps / self.ranks
        return steps * per_step_latency + nbytes * steps / ranks / bus_bytes_per_s


@dataclass
class ProfileTable:
    model: dict                      # model_id, num_layers, hidden_size, vocab_size, dtype, ...
    hardware: dict                   # device, cores, torch version, when
    compute: dict[int, RankCompute]  # threads per rank -> costs
    p2p: LinkCost
    allreduce: LinkCost
    controller_per_step_s: float
    controller_per_seq_s: float
    kv_bytes_per_token: int          # whole model, all layers
    memory_available_bytes: int      # for KV + weights on the device (host RAM on CPU)
    meta: dict = field(default_factory=dict)
    host_copy: Optional[LinkCost] = None   # device <-> host memory (Seesaw's KV tier, weights)

    def __post_init__(self) -> None:
        if not self.compute:
            raise ValueError("a profile needs the compute costs of at least one thread count")
        self.compute = {int(k): v for k, v in sorted(self.compute.items(), key=lambda kv: int(kv[0]))}

    def rank_compute(self, threads: int) -> RankCompute:
        """Costs at `threads` per rank (EXTRAPOLATION's rule for an unprofiled count)."""
        if threads in self.compute:
            return self.compute[threads]
        below = [t for t in self.compute if t <= threads]
        base = max(below) if below else min(self.compute)
        return self.compute[base].scaled(base / threads)

    # --- JSON ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "extrapolation": EXTRAPOLATION,
                "model": self.model, "hardware": self.hardware,
                "compute": {str(t): asdict(c) for t, c in self.compute.items()},
                "links": {"p2p": asdict(self.p2p), "allreduce": asdict(self.allreduce),
                          **({"host_copy": asdict(self.host_copy)} if self.host_copy else {})},
                "controller": {"per_step_s": self.controller_per_step_s,
                               "per_seq_s": self.controller_per_seq_s},
                "memory": {"kv_bytes_per_token": self.kv_bytes_per_token,
                           "available_bytes": self.memory_available_bytes},
                "meta": self.meta}

    @classmethod
    def from_json(cls, data: dict) -> "ProfileTable":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} table (format {data.get('format')!r})")
        if data.get("version") != VERSION:
            raise ValueError(f"table version {data.get('version')!r}; this batchinfer reads "
                             f"version {VERSION} (profile again)")
        compute = {int(t): RankCompute(**c) for t, c in data["compute"].items()}
        return cls(data["model"], data["hardware"], compute, LinkCost(**data["links"]["p2p"]),
                   LinkCost(**data["links"]["allreduce"]), data["controller"]["per_step_s"],
                   data["controller"]["per_seq_s"], int(data["memory"]["kv_bytes_per_token"]),
                   int(data["memory"]["available_bytes"]), dict(data.get("meta", {})),
                   LinkCost(**data["links"]["host_copy"]) if "host_copy" in data["links"] else None)

    # --- CSV: one row per number -----------------------------------------------------------------
    def to_csv(self) -> str:
        """section,key,x,value rows; `meta`/`model`/`hardware` values are JSON."""
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["section", "key", "x", "value"])
        writer.writerow(["format", FORMAT, "", VERSION])
        writer.writerow(["extrapolation", "", "", EXTRAPOLATION])
        for name in ("model", "hardware", "meta"):
            writer.writerow([name, "", "", json.dumps(getattr(self, name), sort_keys=True)])
        for threads, comp in self.compute.items():
            section = f"compute.{threads}"
            for table in ("layer_dense", "attn_decode", "lm_head", "sampling"):
                for x, y in getattr(comp, table):
                    writer.writerow([section, table, x, repr(y)])
            for scalar in ("per_seq_s", "attn_prefill_s"):
                writer.writerow([section, scalar, "", repr(getattr(comp, scalar))])
            writer.writerow([section, "points", "", json.dumps(comp.points)])
        for link in ("p2p", "allreduce", "host_copy"):
            if getattr(self, link) is None:
                continue
            for key, value in asdict(getattr(self, link)).items():
                writer.writerow([f"links.{link}", key, "", repr(value)])
        writer.writerow(["controller", "per_step_s", "", repr(self.controller_per_step_s)])
        writer.writerow(["controller", "per_seq_s", "", repr(self.controller_per_seq_s)])
        writer.writerow(["memory", "kv_bytes_per_token", "", self.kv_bytes_per_token])
        writer.writerow(["memory", "available_bytes", "", self.memory_available_bytes])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "ProfileTable":
        data: dict = {"compute": {}, "links": {"p2p": {}, "allreduce": {}}, "controller": {},
                      "memory": {}}
        for row in csv.DictReader(io.StringIO(text)):
            section, key, x, value = row["section"], row["key"], row["x"], row["value"]
            if section == "format":
                data["format"], data["version"] = key, int(value)
            elif section in ("model", "hardware", "meta"):
                data[section] = json.loads(value)
            elif section.startswith("compute."):
                comp = data["compute"].setdefault(section.split(".", 1)[1], {
                    "layer_dense": [], "attn_decode": [], "lm_head": [], "sampling": []})
                if key == "points":
                    comp["points"] = json.loads(value)
                elif x:
                    comp[key].append((int(x), float(value)))
                else:
                    comp[key] = float(value)
            elif section.startswith("links."):
                link = data["links"].setdefault(section.split(".", 1)[1], {})
                link[key] = int(value) if key == "ranks" else float(value)
            elif section in ("controller", "memory"):
                data[section][key] = float(value) if section == "controller" else int(value)
        return cls.from_json(data)

    # --- files ---------------------------------------------------------------------------------
    def save(self, path: Union[str, Path]) -> None:
        """JSON, or CSV when the name ends in .csv."""
        path = Path(path)
        text = self.to_csv() if path.suffix == ".csv" else json.dumps(self.to_json(), indent=1)
        path.write_text(text)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "ProfileTable":
        path = Path(path)
        try:
            text = path.read_text()
            return cls.from_csv(text) if path.suffix == ".csv" else cls.from_json(json.loads(text))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: not a batchinfer profile table ({exc}); make one with "
                              "`batchinfer profile RECIPE --input FILE` (it writes "
                              "profile_table.json to --out)") from exc
