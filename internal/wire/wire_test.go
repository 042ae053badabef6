package wire

import (
	"strings"
	"testing"
)

func TestBody(t *testing.T) {
	tests := []struct {
		name, text string
		fields     []string
		body       string
		err        string
	}{
		{"header and lines", "facts v1\npass 0 1 0 1 -1 -1\n", nil, "pass 0 1 0 1 -1 -1\n", ""},
		{"fields after the version", "warmup v1 pool=1\nop f 0\n", []string{"pool=1"}, "op f 0\n", ""},
		{"blank lines before the header", "\n\nfacts v1\n", nil, "", ""},
		{"a header alone without newline", "facts v1", nil, "", ""},
		{"no header", "pass 0 1 0 1 -1 -1\n", nil, "", `facts: the text starts with "pass 0 1 0 1 -1 -1", not the header "facts v1"`},
		{"another version", "facts v2\n", nil, "", `not the header "facts v1" (this core reads version 1)`},
		{"another protocol", "trace v1\n", nil, "", `starts with "trace v1"`},
		{"empty", "", nil, "", `starts with ""`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fields, body, err := Facts.Body(tc.text)
			if tc.name == "fields after the version" {
				fields, body, err = Warmup.Body(tc.text)
			}
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || body != tc.body || strings.Join(fields, ",") != strings.Join(tc.fields, ",") {
				t.Errorf("got %q %q %v", fields, body, err)
			}
		})
	}
}

func TestHeader(t *testing.T) {
	if got := Warmup.Header("pool=1"); got != "warmup v1 pool=1\n" {
		t.Errorf("%q", got)
	}
	if got := Program.Header(); got != "program v1\n" {
		t.Errorf("%q", got)
	}
}

func FuzzBody(f *testing.F) {
	f.Add("facts v1\npass 0 1 0 1 -1 -1\n")
	f.Add("\n facts v1 x=1\n")
	f.Add("factsv1")
	f.Fuzz(func(t *testing.T, s string) {
		fields, body, err := Facts.Body(s)
		if err != nil {
			return
		}
		if !strings.HasSuffix(s, body) || len(fields) > len(s) {
			t.Fatalf("body %q not a suffix of %q", body, s)
		}
	})
}
