"""Multiple-choice questions end to end, one job per module: the questions (`data`), the answer letters as tokens
(`letters`), where a completion answers and the probability read there from its own logits (`answer`), the same
by another forward (`recompute`), the chain of thought without its answer (`strip`), the judge (`judge`), the
judge reward for TRL (`reward`), a tiny policy warmed up on the answer format (`warm_start`), and
held-out accuracy in sampled completions (`accuracy`)."""
