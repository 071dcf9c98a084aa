"""Input formats and the records the run directory holds."""
