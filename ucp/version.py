"""The library's version (`ucp.__version__`), which every manifest names as its writer."""

__version__ = "0.1.0"
