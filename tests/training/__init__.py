"""Tests of towers/training/ (see that folder's __init__)."""
