package gograph

import "testing"

func TestProcessors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		env     string
		current int
		want    int
	}{
		{"pinned to one core", "", 1, 2},
		{"two cores", "", 2, 0},
		{"many cores", "", 64, 0},
		{"the user chose one", "1", 1, 0},
		{"the user chose four", "4", 4, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := processors(tc.env, tc.current); got != tc.want {
				t.Fatalf("processors(%q, %d) = %d, want %d", tc.env, tc.current, got, tc.want)
			}
		})
	}
}
