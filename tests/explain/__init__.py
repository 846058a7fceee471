"""Tests of towers/explain/ (see that folder's __init__)."""
