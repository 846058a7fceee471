"""Measuring what a tower step costs, phase by phase."""
