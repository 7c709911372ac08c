"""Wide rows through the AVX2 build before (92af228: one pass over the weights a row of x) and after
(chunks, groups of 3), and the AVX-512 build: ms a product of a 14336 x 4096 Q4_1 weight, 1-8 rows.
Run from the repository root: .venv/bin/python benchmarks/results/amd-epyc-avx2/wide_rows_ab.py"""
import re, subprocess, time, pathlib, tempfile, torch, sys
ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))
from rsd_cli import blocks
from tiny import quantise_q4_1
now = blocks.SOURCE
before_src = subprocess.run(["git", "-C", str(ROOT), "show", "92af228:rsd_cli/blocks.py"], capture_output=True,
                            text=True).stdout
folder = pathlib.Path(tempfile.mkdtemp(prefix="rsd-wide-"))
blocks.SOURCE = re.search(r'SOURCE = r"""(.*?)"""', before_src, re.S).group(1)
before = blocks.build(folder / 'before', (*blocks.FLAGS, "-mno-avx512f"))
blocks.SOURCE = now
after = blocks.build(folder / 'after', (*blocks.FLAGS, "-mno-avx512f"))
avx512 = blocks.build(folder / 'avx512', blocks.FLAGS)
torch.manual_seed(0)
w = quantise_q4_1(torch.randn(14336, 4096) * 0.05); b = blocks.quantised_blocks(w); del w
print("weights MB", b.numel() / 1e6)
for rows in (1, 2, 4, 8):
    x = torch.randn(rows, 4096)
    res = {}
    for _ in range(2):
        for name, lib in (("avx2 before", before), ("avx2 now", after), ("avx512", avx512)):
            ts = []
            for _ in range(7):
                t = time.perf_counter(); blocks.blocks_linear(x, b, lib=lib); ts.append(time.perf_counter() - t)
            res.setdefault(name, []).append(sorted(ts)[3] * 1000)
    assert torch.equal(blocks.blocks_linear(x, b, lib=before), blocks.blocks_linear(x, b, lib=after))
    print(rows, " | ".join(f"{k} {min(v):.2f} ms" for k, v in res.items()), flush=True)
