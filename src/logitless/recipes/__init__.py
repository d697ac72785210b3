"""Programs built on the library: the `logitless` subcommands sft, multiple-choice GRPO and grade, and the
warm start they share. Nothing in the library imports from here; nothing here imports the benchmarks."""
