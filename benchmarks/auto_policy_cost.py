"""What `--variant auto`'s own choosing costs, apart from any model: a choice over its ~120
candidate shapes (every 8 steps) with what it worked out still valid (plain steps since) and
after a drafting step, and `next_shape` a step, on made-up costs and acceptance counts.

Run: .venv/bin/python benchmarks/auto_policy_cost.py [--repeats 300]
"""

import argparse
import random
import time

from rsd_cli import auto
from rsd_cli.auto import AutoShape, Costs
from rsd_cli.drafting import make_shape
from rsd_cli.engine import NodeCheck
from rsd_cli.verification import Decision

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=300)
args = parser.parse_args()


def check(tried: int, accepted: int | None) -> NodeCheck:
    return NodeCheck(0, list(range(1, tried + 1)), Decision(accepted, tried, None if accepted is not None else 0), None)


def ms(run) -> float:
    start = time.perf_counter()
    for _ in range(args.repeats):
        run()
    return (time.perf_counter() - start) / args.repeats * 1000


costs = Costs({n: 0.005 + 0.0005 * n for n in auto.TARGET_SIZES}, {n: 0.001 + 0.0002 * n for n in auto.DRAFT_SIZES})
policy = AutoShape(costs, vocab=49152)
policy.measured = {make_shape("ar"): 1.1, make_shape("sd", draft_len=1): 1.2, make_shape("rsd-c", branching=(2,)): 1.25}
rng = random.Random(0)
for _ in range(300):
    policy.acceptance.observe([check(2, rng.choice([0, 1, None])) for _ in range(rng.randint(1, 4))])
policy._choose()
print(f"{len(policy.shapes)} candidate shapes")
print(f"a choice, nothing learnt since the last: {ms(policy._choose):.3f} ms")
print(f"a choice after a drafting step: {ms(lambda: (policy.acceptance.observe([check(2, 0)]), policy._choose())):.3f} ms")
print(f"next_shape, plain steps (a choice every {policy.every}): {ms(policy.next_shape):.4f} ms")
