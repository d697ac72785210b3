"""Programs built on the library: the `logitless` subcommands (sft, multiple-choice GRPO, grade, demo) and the
warm start they share. Nothing in the library imports from here."""
