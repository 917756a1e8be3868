// Package conf holds kvpipe's one defaulting rule, which every config
// struct follows (README, "Configuration"): a zero field takes its
// documented default; a negative one means what its doc says (disabled,
// one attempt) and is refused where the doc gives it no meaning; a maximum
// below its minimum takes its default, raised to the minimum.
package conf

// Or is v, or def when v is zero.
func Or[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// Bounds applies the rule to a minimum and a maximum: each zero one takes
// its default, and a maximum below the minimum takes max(defMax, min).
func Bounds[T ~int64 | ~int](lo, hi, defLo, defHi T) (T, T) {
	lo = Or(lo, defLo)
	if hi == 0 || hi < lo {
		hi = max(defHi, lo)
	}
	return lo, hi
}
