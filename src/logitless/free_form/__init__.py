"""Questions answered by a word or a number rather than a letter: the embedded set (short arithmetic and facts),
loading a user's set, and the TRL dataset. The rewards that replace a completion's answer by the reference answer
(RLPR's `logitless.trl.reference_probability_reward`, `logitless.trl.VeriFreeTrainer`) train on them; no
verifier reads them."""
