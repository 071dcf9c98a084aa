"""The job: reads inputs, drives the engine, writes the run directory and its report."""
