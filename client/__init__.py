"""moed.client."""
