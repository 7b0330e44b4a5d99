"""Reporting: text and Markdown tables, Markdown reports, PNG plots (matplotlib lazily)."""
