"""JSON schemas the structured-output tests run (unit and end to end): bounded strings and
numbers, so that even a random model's constrained output ends within a few hundred tokens."""

SCHEMAS = [
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 300}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"enum": ["red", "green", "blue"]},
    {"const": {"version": 2}},
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{3}$"},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "qty": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["price", "qty"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}, "admin": {"type": "boolean"}},
                "required": ["age", "admin"],
            }
        },
        "required": ["user"],
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 3}]},
    {"type": ["string", "null"], "maxLength": 6},
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 3}, "b": {"type": "boolean"}},
        "required": ["a"],
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/pt"},
        "minItems": 2,
        "maxItems": 2,
    },
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "boolean"}], "items": False},
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["ok", "error"]},
            "code": {"type": "integer", "exclusiveMinimum": 99, "exclusiveMaximum": 600},
        },
        "required": ["status", "code"],
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 2, "maxLength": 6},
            "arguments": {
                "type": "object",
                "properties": {"location": {"type": "string", "maxLength": 10}},
                "required": ["location"],
            },
        },
        "required": ["name", "arguments"],
    },
    {"type": "null"},
    {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "r"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["kind", "side"],
            },
        ]
    },
]
