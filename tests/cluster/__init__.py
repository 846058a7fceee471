"""Tests of towers/cluster/ (see that folder's __init__)."""
