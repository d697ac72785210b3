"""Programs built on the library: the commands behind `logitless` (the library never imports them)."""
