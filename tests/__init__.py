"""The tests, a folder per part of the product; ``tests.support`` holds what they share."""
