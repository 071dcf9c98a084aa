"""Session metrics, report.json / report.md and the plots."""
