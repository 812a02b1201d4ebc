{{/* The release's full name: the release name, with "canaryd" added when it lacks it. */}}
{{- define "canaryd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Cluster-scoped objects: the release namespace in the name, so that releases of the
same name in two namespaces do not collide. */}}
{{- define "canaryd.clusterName" -}}
{{- printf "%s-%s" (include "canaryd.fullname" .) .Release.Namespace | trunc 253 | trimSuffix "-" -}}
{{- end -}}

{{- define "canaryd.selectorLabels" -}}
app.kubernetes.io/name: canaryd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "canaryd.labels" -}}
{{ include "canaryd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "canaryd.serviceAccountName" -}}
{{- if .Values.serviceAccount.name -}}
{{- .Values.serviceAccount.name -}}
{{- else -}}
{{- include "canaryd.fullname" . -}}
{{- end -}}
{{- end -}}

{{/* The operator's service account the admission policy judges, NAMESPACE/NAME. */}}
{{- define "canaryd.operatorAccount" -}}
{{- $account := .Values.admissionPolicy.operatorServiceAccount | default "" | toString -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$" $account) -}}
{{- fail (printf "admissionPolicy.operatorServiceAccount: give the Flink operator's service account as NAMESPACE/NAME (its chart in the namespace flink-operator: --set admissionPolicy.operatorServiceAccount=flink-operator/flink-operator), or admissionPolicy.enabled=false; got %q. The admission policy refuses the stale writes of that account only" $account) -}}
{{- end -}}
{{- $account -}}
{{- end -}}

{{- define "canaryd.leaseName" -}}
{{- .Values.highAvailability.leaseName | default (include "canaryd.fullname" .) -}}
{{- end -}}

{{- define "canaryd.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* canaryd's flags, for the daemon and for `canaryd check` (helm test). */}}
{{- define "canaryd.args" -}}
- --timeout={{ .Values.timeout }}
{{- if .Values.highAvailability.enabled }}
- --leader-elect
{{- end }}
{{- if ne .Values.reconciledBy "watch" }}
- --reconciled-by={{ .Values.reconciledBy }}
{{- end }}
{{- if ne (int .Values.port) 8085 }}
- --port={{ .Values.port }}
{{- end }}
{{- with .Values.operatorMetricsUrl }}
- --operator-metrics-url={{ . }}
{{- end }}
{{- with .Values.kinds }}
- --kind={{ join "," . }}
{{- end }}
{{- with .Values.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "canaryd.env" -}}
- name: CANARYD_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- if ne .Values.logLevel "info" }}
- name: CANARYD_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- end }}
{{- if .Values.admissionPolicy.enabled }}
- name: CANARYD_OPERATOR_ACCOUNT
  value: {{ include "canaryd.operatorAccount" . | quote }}
{{- end }}
{{- with .Values.watchNamespaces }}
- name: WATCH_NAMESPACES
  value: {{ join "," . | quote }}
{{- end }}
{{- if .Values.highAvailability.enabled }}
- name: CANARYD_IDENTITY
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: CANARYD_LEASE_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: CANARYD_LEASE_NAME
  value: {{ include "canaryd.leaseName" . | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}
