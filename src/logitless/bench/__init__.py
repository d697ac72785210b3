"""The benchmarks of `logitless bench`: lmhead, grpo, reward, grade, grade-variance, trl, jax and cli, each
implementation in a fresh process beside what a user would otherwise run (see ARCHITECTURE.md)."""
