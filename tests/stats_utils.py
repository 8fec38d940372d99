"""Statistics shared by the losslessness tests."""
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
