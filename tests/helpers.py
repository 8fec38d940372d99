"""Helpers shared by several test files."""
import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of observed counts against exact probs."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:  # emitted something the target can never emit
        return float("inf"), 0, 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big & (probs > 0)].sum()[None]])
    exp = torch.cat([expected[big], expected[~big & (probs > 0)].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = int(keep.sum()) - 1
    pval = torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2)
    return float(stat), df, float(pval)


# The tensor names SGLang's LlamaForCausalLMEagle3 loader expects (embeddings left out).
SGLANG_KEYS = {
    "fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}
