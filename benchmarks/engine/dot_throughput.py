"""How many multiply-adds per nanosecond one core of this CPU retires with each AVX2 dot-product
instruction sequence a linear layer could be built on: the ceiling an int8 or int16 kernel could
reach against the fp32 FMA one, before any kernel is written.

    python benchmarks/engine/dot_throughput.py

Each sequence runs as a loop of independent chains (inline assembly, so the compiler cannot
reorder or drop it) on one thread; the figure is multiply-adds per ns (the best of --repeat
runs). The sequences:
- fp32: vfmadd231ps (8 per instruction);
- int16: vpmaddwd then vpaddd into an int32 accumulator (16 per pair; int8 codes widened to
  int16, exact);
- int8 signed: vpsignb (the activation's sign moved onto the weight), vpmaddubsw, vpmaddwd with
  ones, vpaddd (32 per four; exact for codes in [-127, 127]: a byte pair sums to at most 32,258);
- int8 7-bit: vpmaddubsw, vpmaddwd, vpaddd (32 per three; the unsigned codes must stay below 128
  or the int16 pair sums saturate).
Needs g++ and an x86-64 CPU with AVX2; prints one JSON object with the host's CPU model and flags.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.common import emit, host_info  # noqa: E402

# name -> (multiply-adds per chain step, the asm of one step on accumulator {a} with scratch {t})
SEQUENCES = {
    "fp32_fma": (8, "vfmadd231ps %%ymm15,%%ymm14,%%ymm{a}\n"),
    "int16_madd": (16, "vpmaddwd %%ymm15,%%ymm14,%%ymm{t}\n vpaddd %%ymm{t},%%ymm{a},%%ymm{a}\n"),
    "int8_signed": (32, "vpsignb %%ymm14,%%ymm15,%%ymm{t}\n"
                        " vpmaddubsw %%ymm{t},%%ymm13,%%ymm{t}\n"
                        " vpmaddwd %%ymm{t},%%ymm12,%%ymm{t}\n"
                        " vpaddd %%ymm{t},%%ymm{a},%%ymm{a}\n"),
    "int8_7bit": (32, "vpmaddubsw %%ymm15,%%ymm13,%%ymm{t}\n vpmaddwd %%ymm{t},%%ymm12,%%ymm{t}\n"
                      " vpaddd %%ymm{t},%%ymm{a},%%ymm{a}\n"),
}
# independent accumulators ymm0-7 (scratch ymm8-11, renamed): FMA's 4-5 cycle latency at two a
# cycle needs eight to reach its rate
CHAINS = 8
STEPS = 200_000_000


def program() -> str:
    loops = []
    for name, (macs, step) in SEQUENCES.items():
        body = "".join(step.format(a=c, t=8 + c % 4) for c in range(CHAINS))
        clobbers = ", ".join(f'"xmm{r}"' for r in range(12))
        asm = body.replace("\n", "\\n")      # one C string literal
        loops.append(f"""
  {{
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < {STEPS // CHAINS}; ++i)
      asm volatile("{asm}" ::: {clobbers});
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s %.3f\\n", "{name}", {macs}.0 * {STEPS} / (s * 1e9));
  }}""")
    return ("#include <chrono>\n#include <cstdio>\nint main() {" + "".join(loops) + "\n}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs; each sequence's best is kept")
    args = ap.parse_args()
    host = host_info()
    if "avx2" not in host.get("isa", []):
        raise SystemExit(f"this CPU ({host.get('cpu')}) has no AVX2")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise SystemExit("needs g++ (or c++) on PATH")
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="dot-throughput-") as tmp:
        source, binary = Path(tmp) / "dots.cpp", Path(tmp) / "dots"
        source.write_text(program(), encoding="utf-8")
        subprocess.run([compiler, "-O2", "-mavx2", "-o", str(binary), str(source)], check=True)
        for _ in range(args.repeat):
            out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                name, rate = line.split()
                best[name] = max(best.get(name, 0.0), float(rate))
    fp32 = best["fp32_fma"]
    emit({"benchmark": "dot_throughput", "host": host, "threads": 1, "repeat": args.repeat,
          "macs_per_ns": {k: round(v, 1) for k, v in best.items()},
          "vs_fp32_fma": {k: round(v / fp32, 2) for k, v in best.items()}})


if __name__ == "__main__":
    main()
