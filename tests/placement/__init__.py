"""Tests of towers/placement/ (see that folder's __init__)."""
