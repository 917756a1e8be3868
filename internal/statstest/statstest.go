// Package statstest checks that a package's value Stats snapshot copies
// every live counter, and that Stats.Add sums every field, so neither can
// silently miss a counter added later.
package statstest

import (
	"reflect"
	"testing"
)

// CheckLoad stores a distinct value in every atomic field of *live (arrays
// of atomics included), calls load, and checks that the snapshot's field of
// the same name holds it. derived names snapshot fields that load computes
// from others rather than copies; the caller checks those.
func CheckLoad[L, S any](t *testing.T, live *L, load func() S, derived ...string) {
	t.Helper()
	v := reflect.ValueOf(live).Elem()
	want := map[string]any{}
	n := int64(1)
	for i := range v.NumField() {
		f, name := v.Field(i), v.Type().Field(i).Name
		if f.Kind() == reflect.Array {
			var vals []any
			for j := range f.Len() {
				vals = append(vals, store(t, f.Index(j).Addr(), n))
				n++
			}
			want[name] = vals
			continue
		}
		want[name] = store(t, f.Addr(), n)
		n++
	}
	snap := reflect.ValueOf(load())
	if snap.NumField() != len(want)+len(derived) {
		t.Errorf("snapshot has %d fields, live counters %d and %d derived", snap.NumField(), len(want), len(derived))
	}
	for name, w := range want {
		got := snap.FieldByName(name)
		if !got.IsValid() {
			t.Errorf("snapshot has no field %s", name)
			continue
		}
		if vals, ok := w.([]any); ok {
			for j, wv := range vals {
				if g := got.Index(j).Interface(); g != wv {
					t.Errorf("%s[%d] = %v, want %v", name, j, g, wv)
				}
			}
			continue
		}
		if g := got.Interface(); g != w {
			t.Errorf("%s = %v, want %v", name, g, w)
		}
	}
}

// store calls the atomic's Store with n (or true) and returns the value the
// snapshot should show.
func store(t *testing.T, ptr reflect.Value, n int64) any {
	t.Helper()
	m := ptr.MethodByName("Store")
	if !m.IsValid() {
		t.Fatalf("%s is not an atomic", ptr.Elem().Type())
	}
	arg := m.Type().In(0)
	var v reflect.Value
	switch arg.Kind() {
	case reflect.Bool:
		v = reflect.ValueOf(true)
	case reflect.Int64:
		v = reflect.ValueOf(n)
	case reflect.Uint64:
		v = reflect.ValueOf(uint64(n))
	default:
		t.Fatalf("unexpected atomic of %s", arg)
	}
	m.Call([]reflect.Value{v})
	return v.Interface()
}

// CheckAdd fills two snapshots with distinct numbers in every numeric field
// and checks that a.Add(b) leaves each the sum. Fields named in skip (such
// as booleans with their own rule) are left out.
func CheckAdd[S any](t *testing.T, add func(a *S, b S), skip ...string) {
	t.Helper()
	var a, b S
	av, bv := reflect.ValueOf(&a).Elem(), reflect.ValueOf(&b).Elem()
	fill(av, 1)
	fill(bv, 1000)
	var want S
	wv := reflect.ValueOf(&want).Elem()
	fill(wv, 1)
	sum(wv, bv)
	add(&a, b)
	for i := range av.NumField() {
		name := av.Type().Field(i).Name
		if contains(skip, name) {
			continue
		}
		if !reflect.DeepEqual(av.Field(i).Interface(), wv.Field(i).Interface()) {
			t.Errorf("after Add, %s = %v, want %v", name, av.Field(i).Interface(), wv.Field(i).Interface())
		}
	}
}

func fill(v reflect.Value, n int64) int64 {
	switch v.Kind() {
	case reflect.Struct:
		for i := range v.NumField() {
			n = fill(v.Field(i), n)
		}
	case reflect.Array:
		for j := range v.Len() {
			n = fill(v.Index(j), n)
		}
	case reflect.Int64, reflect.Int:
		v.SetInt(n)
		n++
	case reflect.Uint64:
		v.SetUint(uint64(n))
		n++
	}
	return n
}

func sum(dst, src reflect.Value) {
	switch dst.Kind() {
	case reflect.Struct:
		for i := range dst.NumField() {
			sum(dst.Field(i), src.Field(i))
		}
	case reflect.Array:
		for j := range dst.Len() {
			sum(dst.Index(j), src.Index(j))
		}
	case reflect.Int64, reflect.Int:
		dst.SetInt(dst.Int() + src.Int())
	case reflect.Uint64:
		dst.SetUint(dst.Uint() + src.Uint())
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
