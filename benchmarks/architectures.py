"""Which transformers architectures rsd decodes exactly, on tiny random models of each (offline,
seconds each): for every architecture, a tree's forward after a 14-token cache against a full
forward of each node's path, the next token after the accepted path is kept against a fresh
forward, and greedy decoding of every variant against the target's own greedy tokens (a
second random model of the same kind as the draft). Architectures whose layers take no tree
(engine.limit_of) should refuse what they cannot take in one line and decode the rest exactly.
"chain" is how far a 3-token forward after a 9-token cache is from the same tokens read one at a
time, through transformers alone: what a model with recurrent layers needs near 0 to decode
chains (engine.CHAIN_RECURRENT). Where rsd's static-cache runtime covers the architecture
(compiled.unsupported), the same tree, pruning and greedy checks run on it too (uncompiled: the
same layer code a compiled graph traces); otherwise the line says why it does not.

    .venv/bin/python benchmarks/architectures.py [gpt2 lfm2 ...]   (default: all below)

Prints one line per architecture: the largest logit difference of the tree and after pruning, and
each variant's outcome ("ok", "WRONG", or the error's first words), then the static-cache
runtime's ("static: ...").
"""

import sys
import warnings

import torch

V = 64  # vocabulary
PROMPT = [(i * 7 + 3) % V for i in range(14)]  # longer than the windows and chunks of 8 below
ATTENTION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
GQA = dict(ATTENTION, num_key_value_heads=2)
ARCHITECTURES = {  # model_type -> tiny config (the sizes each config names its own way)
    "llama": GQA,
    "mistral": dict(GQA, sliding_window=8),
    "qwen2": dict(GQA, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": dict(GQA, head_dim=8),
    "qwen3_moe": dict(GQA, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
    "gemma": dict(GQA, head_dim=8),
    "gemma2": dict(GQA, head_dim=8, sliding_window=8),
    "gemma3_text": dict(GQA, num_hidden_layers=3, head_dim=8, sliding_window=8),
    "gemma4_text": dict(GQA, num_hidden_layers=6, head_dim=8, global_head_dim=8, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
                        vocab_size_per_layer_input=V, hidden_size_per_layer_input=8),
    "gemma3n_text": dict(GQA, num_hidden_layers=4, head_dim=8, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                         vocab_size_per_layer_input=V, hidden_size_per_layer_input=8, laurel_rank=4,
                         altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4),
    "qwen3_5_text": dict(GQA, num_hidden_layers=4, head_dim=8),
    "gpt_oss": dict(GQA, intermediate_size=32, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8),
    "mixtral": dict(GQA, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "qwen2_moe": dict(GQA, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                      num_experts_per_tok=2),
    "olmoe": dict(GQA, num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(GQA, num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(GQA, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "deepseek_v2": dict(ATTENTION, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1),
    "deepseek_v3": dict(ATTENTION, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
    "glm4_moe_lite": dict(ATTENTION, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                          v_head_dim=8, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                          topk_group=1),
    "minicpm3": dict(ATTENTION, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    "youtu": dict(ATTENTION, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
    "cohere2": dict(GQA, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2),
    "olmo3": dict(GQA, num_hidden_layers=4, sliding_window=8),
    "exaone4": dict(GQA, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2),
    "glm4": dict(GQA, head_dim=8, pad_token_id=0),
    "ernie4_5": dict(GQA, head_dim=8),
    "ernie4_5_moe": dict(GQA, head_dim=8, moe_num_experts=4, moe_k=2, moe_intermediate_size=16,
                         moe_num_shared_experts=1, moe_layer_start_index=1),
    "seed_oss": dict(GQA, head_dim=8),
    "hunyuan_v1_dense": dict(GQA, head_dim=8),
    "arcee": GQA,
    "apertus": GQA,
    "nemotron": dict(GQA, head_dim=8),
    "phi": ATTENTION,
    "phi3": dict(GQA, pad_token_id=0),
    "stablelm": dict(ATTENTION, hidden_size=64, num_key_value_heads=4),
    "olmo2": ATTENTION,
    "granite": ATTENTION,
    "smollm3": dict(GQA, num_hidden_layers=4, pad_token_id=0),
    "cohere": ATTENTION,
    "starcoder2": dict(GQA, sliding_window=8),
    "falcon": dict(ATTENTION, new_decoder_architecture=False),
    "gpt_neox": dict(ATTENTION, max_position_embeddings=128),
    "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4),
    "gpt_bigcode": dict(n_embd=32, n_layer=2, n_head=4),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
    "gpt_neo": dict(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    window_size=8),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "mpt": dict(d_model=32, n_layers=2, n_heads=4),
    "llama4_text": dict(GQA, head_dim=8, intermediate_size_mlp=64, attention_chunk_size=8, num_local_experts=2),
    "lfm2": dict(GQA, num_hidden_layers=4, block_ff_dim=64, full_attn_idxs=[1, 3]),
    "lfm2_moe": dict(GQA, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, num_dense_layers=1,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mamba2": dict(hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, num_heads=4, head_dim=16, n_groups=1),
    "bamba": dict(GQA, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
                  mamba_d_conv=4, mamba_proj_bias=True),
    "granitemoehybrid": dict(GQA, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, num_local_experts=2, num_experts_per_tok=1),
    "falcon_mamba": dict(hidden_size=32, num_hidden_layers=2, state_size=4, expand=2),
    "mamba": dict(hidden_size=32, num_hidden_layers=2, state_size=4, expand=2),
    "jamba": dict(GQA, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2,
                  mamba_d_state=4),
    "falcon_h1": dict(GQA, head_dim=8, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
    "nemotron_h": dict(GQA, num_hidden_layers=5, head_dim=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                       ssm_state_size=8,
                       layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]),
    "qwen3_next": dict(GQA, num_hidden_layers=4, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
}
VARIANTS = ("ar", "sd", "rsd-c", "rsd-s", "auto")


def tiny(kind: str, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=V, **ARCHITECTURES[kind])).eval()
    with torch.no_grad():  # (peakier distributions than the initialiser's: logits that differ show)
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(3.0)
    return model


def last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def tree_and_pruning(model, static: bool = False) -> tuple[float, float]:
    """The largest logit difference of a 5-node tree's forward after the prompt, and of the next
    token after keeping the root and one path, against full forwards (on transformers' forward, or
    with `static` on rsd's static-cache runtime)."""
    from rsd_cli.compiled import CompiledModel, StaticLM
    from rsd_cli.engine import CachedLM
    from rsd_cli.tree import DraftTree

    lm = StaticLM(CompiledModel(model, compile=False), V, 64) if static else CachedLM(model, V)
    lm.extend(PROMPT)
    tree = DraftTree.rooted_at(5)
    a, _ = tree.add_draw(0, 2)
    b, _ = tree.add_draw(0, 4)
    c, _ = tree.add_draw(a, 1)
    tree.add_draw(b, 9)
    base = len(PROMPT)
    visible = torch.cat([torch.ones(len(tree), base, dtype=torch.bool), tree.ancestry()], dim=1)
    logits = lm.forward(tree.tokens, [base + depth for depth in tree.depths], visible)
    tree_error = max((logits[node] - last_logits(model, PROMPT + [tree.tokens[k] for k in tree.path_to(node)]))
                     .abs().max().item() for node in range(len(tree)))
    lm.keep(list(range(base)) + [base + n for n in (0, a, c)])
    after = lm.extend([3], last_only=True)[-1]
    return tree_error, (after - last_logits(model, PROMPT + [5, 2, 1, 3])).abs().max().item()


def chain_after_cache(model) -> float:
    """The largest logit difference between a 3-token forward after a 9-token cache and the same
    tokens one at a time (transformers' own cache and forward, given their positions as rsd gives them:
    Bamba's forward, for one, numbers the tokens from 0 without them, whatever the cache holds)."""
    from transformers import DynamicCache

    from rsd_cli.engine import cache_argument

    name = cache_argument(model)  # ("cache" since transformers 5.24; older ones' forwards ignore it)
    with torch.no_grad():
        rows = []
        for chunks in ([[5, 2, 8]], [[5], [2], [8]]):
            cache = DynamicCache(config=model.config)
            model(torch.tensor([PROMPT[:9]]), use_cache=True, **{name: cache})
            logits, at = [], 9
            for chunk in chunks:
                positions = torch.arange(at, at + len(chunk))[None]
                logits.append(model(torch.tensor([chunk]), position_ids=positions, use_cache=True,
                                    **{name: cache}).logits[0])
                at += len(chunk)
            rows.append(torch.cat(logits))
    return (rows[0] - rows[1]).abs().max().item()


def greedy_variants(target, draft, static: bool = False) -> dict[str, str]:
    from rsd_cli.compiled import CompiledModel
    from rsd_cli.drafting import make_shape
    from rsd_cli.engine import Decoder, Runtimes
    from rsd_cli.sampling import SamplingParams

    runtimes = Runtimes(CompiledModel(target, compile=False), CompiledModel(draft, compile=False)) if static else None

    tokens = list(PROMPT)
    for _ in range(24):
        tokens.append(int(last_logits(target, tokens).argmax()))
    expected, outcomes = tokens[len(PROMPT):], {}
    for variant in VARIANTS:
        try:
            decoder = Decoder(target, draft, V, make_shape(variant, branching=(2, 2)), SamplingParams(temperature=0),
                              set(), runtimes=runtimes)
            got = [t for event in decoder.generate(PROMPT, 24, 0) for t in event.emitted]
            outcomes[variant] = "ok" if got == expected else "WRONG"
        except Exception as error:  # (what a user would see, in one line)
            outcomes[variant] = f"{type(error).__name__}: {str(error)[:70]}"
    return outcomes


def main() -> None:
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.set_num_threads(1)
    for kind in sys.argv[1:] or ARCHITECTURES:
        try:
            target, draft = tiny(kind, 0), tiny(kind, 1)
        except Exception as error:
            print(f"{kind:12s} not built here: {type(error).__name__}: {str(error)[:80]}")
            continue
        try:
            tree_error, pruned_error = tree_and_pruning(target)
            errors = f"tree {tree_error:.1e}, after pruning {pruned_error:.1e}"
        except Exception as error:
            errors = f"tree: {type(error).__name__}: {str(error)[:70]}"
        try:
            errors += f", chain {chain_after_cache(target):.1e}"
        except Exception as error:
            errors += f", chain: {type(error).__name__}"
        try:
            outcomes = greedy_variants(target, draft)
        except Exception as error:  # (the reference itself: a config this script got wrong)
            outcomes = f"no greedy reference: {type(error).__name__}: {str(error)[:70]}"
        print(f"{kind:12s} {errors} | {outcomes} | static: {on_the_static_runtime(target, draft)}", flush=True)


def on_the_static_runtime(target, draft) -> str:
    """The tree, pruning and greedy checks on rsd's static-cache runtime, or why it does not cover
    the architecture."""
    from rsd_cli.compiled import unsupported

    reason = unsupported(target)
    if reason is not None:
        return f"not covered ({reason[:60]})"
    try:
        tree_error, pruned_error = tree_and_pruning(target, static=True)
        outcomes = greedy_variants(target, draft, static=True)
    except Exception as error:  # (a family the runtime takes but gets wrong)
        return f"{type(error).__name__}: {str(error)[:70]}"
    verdict = "all ok" if set(outcomes.values()) == {"ok"} else outcomes
    return f"tree {tree_error:.1e}, after pruning {pruned_error:.1e}, greedy {verdict}"


if __name__ == "__main__":
    main()
