"""h3's command line: thin Typer commands over `h3core` (flags -> config -> one call -> render)."""
