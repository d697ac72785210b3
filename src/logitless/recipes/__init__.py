"""Programs built on the library: the `logitless` subcommands sft, grpo (multiple-choice GRPO), grade and distill.
Nothing in the library imports from here; nothing here imports the benchmarks."""
