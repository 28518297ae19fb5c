"""Conversion factors to SI base units (metre, kilogram, second, kelvin offsets apart)."""

FACTORS = {
    "m": 1.0,
    "km": 1000.0,
    "cm": 0.01,
    "mm": 0.001,
    "mi": 1609.344,
    "ft": 0.3048,
    "in": 0.0254,
    "kg": 1.0,
    "g": 0.001,
    "lb": 0.45359237,
    "oz": 0.028349523125,
    "s": 1.0,
    "min": 60.0,
    "h": 3600.0,
}
DIMENSION = {
    **dict.fromkeys(["m", "km", "cm", "mm", "mi", "ft", "in"], "length"),
    **dict.fromkeys(["kg", "g", "lb", "oz"], "mass"),
    **dict.fromkeys(["s", "min", "h"], "time"),
}
