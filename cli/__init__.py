"""The needle command: one subcommand per stage (the top floor: it may import every package)."""
