"""Tests of towers/step/ (see that folder's __init__)."""
