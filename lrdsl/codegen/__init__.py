"""IR -> plan -> schedule -> rendered module source (templates/ holds the Jinja templates)."""
