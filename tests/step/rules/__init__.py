"""Tests of towers/step/rules/ (see that folder's __init__)."""
