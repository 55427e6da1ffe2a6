from jpipe import F, B, register_schedule

@register_schedule("gpipe")
def gpipe(num_ranks, num_microbatches):
    """All forwards, then all backwards."""
    return [[F(r, m) for m in range(num_microbatches)] + [B(r, m) for m in range(num_microbatches)] for r in range(num_ranks)]
