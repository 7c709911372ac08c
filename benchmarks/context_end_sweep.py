"""Answers that reach the end of the models' context, on the tests' tiny models of every kind
(tests/tiny.py): for each kind, every variant the pair takes x T in {0, 1} x 1, 2 and 5 tokens left
after the prompt, on transformers' forward and (where it takes the kind) rsd's static-cache runtime,
with its steps decided on the device and queued ahead as a GPU runs them (--device-steps). Greedy,
every variant and runtime must give the same tokens; at T = 1 each answer must end at the context
with the tokens left. Found GPT-Neo's failure on transformers' forward (its attention takes no more
keys than its context) and, before it, GPT-2's and OPT's learned positions indexed past their end.

    .venv/bin/python benchmarks/context_end_sweep.py [--kinds llama,gpt2,...] [--device-steps]

Prints a line per kind (its context, the runtimes tried, the problems found) and one per problem;
about a minute for every kind on a 2-core AMD EPYC.
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import tiny  # noqa: E402
from rsd_cli import compiled  # noqa: E402
from rsd_cli.compiled import CompiledModel  # noqa: E402
from rsd_cli.drafting import make_shape  # noqa: E402
from rsd_cli.engine import Decoder, Runtimes  # noqa: E402
from rsd_cli.sampling import SamplingParams  # noqa: E402

V = 40
KINDS = ("llama,gpt2,opt,gpt_bigcode,qwen2,gemma3,phi3,mistral,qwen3,gemma,gemma2,smollm3,granite,olmo2,olmo3,"
         "seed_oss,exaone4,ernie4_5,hunyuan,glm4,cohere2,cohere,mixtral,qwen2_moe,qwen3_moe,olmoe,granitemoe,"
         "granitemoeshared,starcoder2,stablelm,nemotron,arcee,phi,gpt_neox,gpt_oss,apertus,gpt_bigcode-mha,"
         "ernie4_5_moe,phimoe,minicpm3,youtu,deepseek_v2,deepseek_v3,glm4_moe_lite,gptj,falcon,falcon-7b,"
         "falcon-sequential,falcon-rw,gpt_neo,llama4,bloom,mpt,lfm2,lfm2_moe,qwen3_5,granite4,nemotron_h,bamba,"
         "mamba2,mamba,falcon_h1,phi3-longrope,gemma4,gemma3n")
SHAPES = [make_shape("ar"), make_shape("sd", draft_len=3), make_shape("mss", branching=(2, 1)),
          make_shape("spectr", num_drafts=2, depth=2), make_shape("rsd-c", branching=(2, 2)),
          make_shape("rsd-s", beam_width=2, depth=2), make_shape("lookup", draft_len=3), make_shape("auto")]



def build(kind: str, seed: int, layers: int):
    """The tests' tiny model of this kind: tiny_recurrent's Mamba and Falcon-H1, tiny_relative's the others."""
    if kind == "llama":
        return tiny.tiny_model(V, layers, seed, scale=0.3)
    maker = tiny.tiny_recurrent if kind in ("mamba", "falcon_h1") else tiny.tiny_relative
    return maker(kind, V, layers=layers, seed=seed)


def sweep(kind: str, device_steps: bool) -> None:
    target, draft = build(kind, 0, 2), build(kind, 1, 1)
    config = target.config
    context = min(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
                  or getattr(config, "max_seq_len", None) or 256, 300)
    runtimes = {"transformers": None}
    if compiled.unsupported(target) is None and compiled.unsupported(draft) is None:
        runtimes["static"] = Runtimes(CompiledModel(target, False, static_shapes=device_steps),
                                      CompiledModel(draft, False, static_shapes=device_steps), "auto")
    problems = 0
    for left in (1, 2, 5):
        prompt = [3 + (i * 7) % (V - 3) for i in range(context - left)]
        for temperature in (0.0, 1.0):
            greedy = None
            for name, runtime in runtimes.items():
                for shape in SHAPES:
                    decoder = Decoder(target, draft, V, shape, SamplingParams(temperature), {2}, context, runtime)
                    if not decoder.takes(shape.variant):
                        continue
                    if device_steps:
                        decoder.device_steps = decoder.steps_ahead = True
                    try:
                        events = list(decoder.generate(prompt, 10, seed=0))
                    except Exception as error:
                        problems += 1
                        print(f"  {kind} {left} left T={temperature} {name} {shape.describe()}: "
                              f"{type(error).__name__}: {str(error)[:160]}")
                        continue
                    answer, finished = [t for e in events for t in e.emitted], events[-1].finished
                    if temperature == 0 and greedy is None:
                        greedy = answer, finished
                    wrong = (answer, finished) != greedy if temperature == 0 else \
                        finished not in ("context", "eos") or len(answer) > left
                    if wrong:
                        problems += 1
                        print(f"  {kind} {left} left T={temperature} {name} {shape.describe()}: "
                              f"{answer} ({finished}), greedy {greedy}")
    print(f"{kind}: context {context}, {' and '.join(runtimes)}: {problems} problems", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=KINDS)
    parser.add_argument("--device-steps", action="store_true",
                        help="steps decided on the device and queued ahead (what a GPU runs), static shapes")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for kind in args.kinds.split(","):
        sweep(kind, args.device_steps)
