"""Multiple-choice questions end to end: the questions (`data`), reading the answer's probability from
the policy's logits, the judge, and the judge reward for TRL (`reward`); and a tiny policy warmed up on
the answer format (`warm_start`)."""
