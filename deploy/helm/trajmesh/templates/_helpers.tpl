{{/* Chart name, truncated to 63 characters (DNS label). */}}
{{- define "trajmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name. Component names append "-<component>", so keep it ≤ 40. */}}
{{- define "trajmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of one component's objects: (dict "root" $ "component" "rollout"). */}}
{{- define "trajmesh.componentName" -}}
{{- printf "%s-%s" (include "trajmesh.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trajmesh.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "trajmesh.labels" -}}
helm.sh/chart: {{ include "trajmesh.chart" . }}
app.kubernetes.io/name: {{ include "trajmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trajmesh
{{- end -}}

{{/* Labels of one component: (dict "root" $ "component" "rollout"). */}}
{{- define "trajmesh.componentLabels" -}}
{{ include "trajmesh.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Stable selector labels of one component. */}}
{{- define "trajmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trajmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Selector matching every trajmesh mesh pod of this release (NetworkPolicy peers). */}}
{{- define "trajmesh.meshPodSelector" -}}
matchLabels:
  app.kubernetes.io/instance: {{ .Release.Name }}
  trajmesh.io/mesh: "true"
{{- end -}}

{{/* A pinned image reference; refuses a missing repository, `latest` and empty tags. */}}
{{- define "trajmesh.image" -}}
{{- if not .repository -}}
{{- fail "an image is not set: the chart has no default images. Use those the release workflow (.github/workflows/release.yml) pushes on a version tag, ghcr.io/OWNER/trajmesh-gpu from docker/Dockerfile.gpu (set rollout.image, rollout.sglang.image, learner.image) and ghcr.io/OWNER/trajmesh-cpu from docker/Dockerfile.cpu (set environment.image, grader.image, store.image, tests.image), or build both from the repository root and push them yourself; set repository and a pinned tag for each (docs/KUBERNETES.md, Images)" -}}
{{- end -}}
{{- if or (not .tag) (eq (toString .tag) "latest") -}}
{{- fail (printf "image %s needs a pinned tag (got %q)" .repository (toString .tag)) -}}
{{- end -}}
{{- printf "%s:%s" .repository (toString .tag) -}}
{{- end -}}

{{/* ServiceAccount name of a component. */}}
{{- define "trajmesh.serviceAccountName" -}}
{{- $c := index .root.Values .component -}}
{{- if $c.serviceAccount.create -}}
{{- default (include "trajmesh.componentName" .) $c.serviceAccount.name -}}
{{- else -}}
{{- default "default" $c.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Is an API group/version available (cluster discovery or capabilities.apiVersions)? */}}
{{- define "trajmesh.hasAPI" -}}
{{- if or (.root.Capabilities.APIVersions.Has .api) (has .api .root.Values.capabilities.apiVersions) -}}
true
{{- end -}}
{{- end -}}

{{/* Is a component autoscaled by KEDA (its Deployment then omits spec.replicas)? */}}
{{- define "trajmesh.autoscaled" -}}
{{- $c := index .root.Values .component -}}
{{- if and .root.Values.keda.enabled $c.enabled (dig "autoscaling" "enabled" false $c) -}}
true
{{- end -}}
{{- end -}}

{{/* In-cluster NATS service names. */}}
{{- define "trajmesh.natsName" -}}{{ include "trajmesh.componentName" (dict "root" . "component" "nats") }}{{- end -}}
{{- define "trajmesh.natsHeadless" -}}{{ include "trajmesh.natsName" . }}-headless{{- end -}}

{{- define "trajmesh.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s.%s.svc:4222" (include "trajmesh.natsName" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.nats.external.url -}}
{{- end -}}
{{- end -}}

{{/* host:port that KEDA polls for JetStream consumer state (headless: finds the consumer leader). */}}
{{- define "trajmesh.natsMonitoringEndpoint" -}}
{{- if .Values.nats.enabled -}}
{{- printf "%s.%s.svc.cluster.local:8222" (include "trajmesh.natsHeadless" .) .Release.Namespace -}}
{{- else -}}
{{- required "nats.external.monitoringEndpoint is required for KEDA scaling with an external NATS" .Values.nats.external.monitoringEndpoint -}}
{{- end -}}
{{- end -}}

{{- define "trajmesh.redisName" -}}{{ include "trajmesh.componentName" (dict "root" . "component" "redis") }}{{- end -}}

{{- define "trajmesh.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc:6379/0" (include "trajmesh.redisName" .) .Release.Namespace -}}
{{- else -}}
{{- required "redis.external.url is required when redis.enabled=false" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Secret holding the Redis password, "" when auth is off. */}}
{{- define "trajmesh.redisSecretName" -}}
{{- if .Values.redis.auth.enabled -}}
{{- if .Values.redis.auth.create -}}
{{- printf "%s-auth" (include "trajmesh.redisName" .) -}}
{{- else -}}
{{- required "redis.auth.existingSecret is required when redis.auth.enabled and not redis.auth.create" .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "trajmesh.hfTokenSecretName" -}}
{{- if .Values.model.hfToken.create -}}
{{- printf "%s-hf-token" (include "trajmesh.fullname" .) -}}
{{- else -}}
{{- .Values.model.hfToken.existingSecret -}}
{{- end -}}
{{- end -}}

{{/* Stream names as the mesh creates them (infra.namespace prefixes them). */}}
{{- define "trajmesh.stream" -}}
{{- if .root.Values.trajmesh.namespace -}}
{{- printf "%s_%s" .root.Values.trajmesh.namespace .stream -}}
{{- else -}}
{{- .stream -}}
{{- end -}}
{{- end -}}

{{/* model.path inside pods, from model.source. */}}
{{- define "trajmesh.modelPath" -}}
{{- $src := .Values.model.source -}}
{{- if hasPrefix "hf://" $src -}}
{{- printf "/models/hf/%s" (trimPrefix "hf://" $src) -}}
{{- else if hasPrefix "pvc://" $src -}}
{{- $parts := splitList "/" (trimPrefix "pvc://" $src) -}}
{{- printf "/models/pvc/%s" (join "/" (rest $parts)) | trimSuffix "/" -}}
{{- else if hasPrefix "/" $src -}}
{{- $src -}}
{{- else -}}
{{- fail (printf "model.source must be hf://ORG/NAME, pvc://CLAIM/PATH or an absolute path; got %q" $src) -}}
{{- end -}}
{{- end -}}

{{- define "trajmesh.sharedClaim" -}}
{{- default (include "trajmesh.componentName" (dict "root" . "component" "shared")) .Values.sharedVolume.existingClaim -}}
{{- end -}}

{{/*
Pod-level volumes for a mesh pod: config, the writable runtime dir and, when asked, the shared
volume and the model. (dict "root" $ "shared" true "model" true)
*/}}
{{- define "trajmesh.meshVolumes" -}}
{{- $root := .root -}}
- name: config
  configMap:
    name: {{ include "trajmesh.fullname" $root }}-config
- name: runtime
  emptyDir:
    sizeLimit: 64Mi
{{- if .shared }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ include "trajmesh.sharedClaim" $root }}
{{- end }}
{{- if .model }}
{{- if hasPrefix "hf://" $root.Values.model.source }}
- name: model
  emptyDir:
    sizeLimit: {{ $root.Values.model.cacheSizeLimit }}
{{- else if hasPrefix "pvc://" $root.Values.model.source }}
- name: model
  persistentVolumeClaim:
    claimName: {{ first (splitList "/" (trimPrefix "pvc://" $root.Values.model.source)) }}
    readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/* Mounts matching trajmesh.meshVolumes. */}}
{{- define "trajmesh.meshVolumeMounts" -}}
{{- $root := .root -}}
- name: config
  mountPath: /etc/trajmesh
  readOnly: true
- name: runtime
  mountPath: /run/trajmesh
{{- if .shared }}
- name: shared
  mountPath: {{ $root.Values.sharedVolume.mountPath }}
{{- end }}
{{- if .model }}
{{- if hasPrefix "hf://" $root.Values.model.source }}
- name: model
  mountPath: /models/hf
  readOnly: true
{{- else if hasPrefix "pvc://" $root.Values.model.source }}
- name: model
  mountPath: /models/pvc
  readOnly: true
{{- end }}
{{- end }}
{{- end -}}

{{/*
weights.local_dir of the engine pods (rollout, evaluator) when trajmesh.config weights.sync is
delta: rollout.localWeights.mountPath, where the pod's local-weights volume is mounted in the
trajmesh container (which rebuilds each checkpoint there) and in the SGLang/vLLM container (which
loads it). "" with weights.sync full. A weights.local_dir in trajmesh.config other than that path
fails the render: the engine container would not see it.
*/}}
{{- define "trajmesh.localWeightsDir" -}}
{{- $cfg := .Values.trajmesh.config -}}
{{- if eq (toString (dig "weights" "sync" "full" $cfg)) "delta" -}}
{{- $mount := .Values.rollout.localWeights.mountPath -}}
{{- $given := toString (dig "weights" "local_dir" "" $cfg | default "") -}}
{{- if and $given (ne (clean $given) (clean $mount)) -}}
{{- fail (printf "trajmesh.config.weights.local_dir %q: with weights.sync delta the chart mounts the local-weights volume (rollout.localWeights) at %q in the rollout/evaluator container and in its SGLang/vLLM container, and sets weights.local_dir to it; leave weights.local_dir unset, or move the volume with rollout.localWeights.mountPath" $given $mount) -}}
{{- end -}}
{{- $mount -}}
{{- end -}}
{{- end -}}

{{/*
Init container fetching an hf:// model into the pod-local cache (nothing for other sources).
(dict "root" $ "image" <image values> "tokenizerOnly" bool)
*/}}
{{- define "trajmesh.fetchModelInit" -}}
{{- $root := .root -}}
{{- if hasPrefix "hf://" $root.Values.model.source }}
- name: fetch-model
  image: {{ include "trajmesh.image" .image }}
  imagePullPolicy: {{ .image.pullPolicy }}
  command: ["python", "-c"]
  args:
    - |
      import os
      from huggingface_hub import snapshot_download
      patterns = ["*.json", "tokenizer*", "*.txt", "*.model"] if os.environ["TOKENIZER_ONLY"] == "1" else None
      snapshot_download(repo_id=os.environ["REPO_ID"], revision=os.environ["REVISION"],
                        local_dir=os.environ["TARGET"], allow_patterns=patterns)
  env:
    - {name: REPO_ID, value: {{ trimPrefix "hf://" $root.Values.model.source | quote }}}
    - {name: REVISION, value: {{ $root.Values.model.revision | quote }}}
    - {name: TARGET, value: {{ include "trajmesh.modelPath" $root | quote }}}
    - {name: TOKENIZER_ONLY, value: {{ ternary "1" "0" (default false .tokenizerOnly) | quote }}}
    - {name: HF_HOME, value: /models/hf/.cache}
    {{- if (include "trajmesh.hfTokenSecretName" $root) }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ include "trajmesh.hfTokenSecretName" $root }}
          key: {{ $root.Values.model.hfToken.key }}
    {{- end }}
  securityContext:
    allowPrivilegeEscalation: false
  resources:
    requests: {cpu: 500m, memory: 1Gi}
    limits: {memory: 4Gi}
  volumeMounts:
    - name: model
      mountPath: /models/hf
{{- end }}
{{- end -}}

{{/*
Env of a mesh container: secrets the entrypoint injects into the config, and the NATS user and
password of its own role only (TRAJMESH_NATS_USER / TRAJMESH_NATS_PASSWORD, read by
trajmesh.security). (dict "root" $ "component" "rollout")
*/}}
{{- define "trajmesh.meshEnv" -}}
{{- $root := .root -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP  # where the environment's pods reach a rollout's agent endpoint (rollout.agent_endpoint)
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if and (not $root.Values.nats.enabled) $root.Values.nats.external.urlSecret.name }}
- name: TRAJMESH_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $root.Values.nats.external.urlSecret.name }}
      key: {{ $root.Values.nats.external.urlSecret.key }}
{{- end }}
{{- $natsSecret := include "trajmesh.natsAuthSecretName" $root }}
{{- if and $natsSecret (has .component (include "trajmesh.natsRoles" $root | fromJsonArray)) }}
- {name: TRAJMESH_NATS_USER, value: {{ .component | quote }}}
- name: TRAJMESH_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $natsSecret }}
      key: {{ .component }}
{{- end }}
{{- if (include "trajmesh.redisSecretName" $root) }}
- name: TRAJMESH_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "trajmesh.redisSecretName" $root }}
      key: {{ $root.Values.redis.auth.key }}
{{- end }}
{{- end -}}

{{/* HTTP /healthz probes on the named metrics port: (dict "probes" .Values.x.probes). */}}
{{- define "trajmesh.probes" -}}
startupProbe:
  httpGet: {path: /healthz, port: metrics}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  httpGet: {path: /healthz, port: metrics}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  httpGet: {path: /healthz, port: metrics}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end -}}

{{/* Pod scheduling fields shared by all components: (component values). */}}
{{- define "trajmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
Pod securityContext of a pod that runs trajmesh's own images (USER 10001): podSecurityContext, so
fsGroup makes its volumes (the shared claim, the store's) writable by that uid.
*/}}
{{- define "trajmesh.podSecurityContext" -}}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "trajmesh.containerSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/*
securityContext of a container that runs the code sandbox (environment, grader): the defaults
above plus the seccomp/AppArmor profiles that let it create namespaces, mount and pivot_root.
*/}}
{{- define "trajmesh.sandboxSecurityContext" -}}
{{- $s := .Values.sandbox -}}
securityContext:
  allowPrivilegeEscalation: false
  capabilities:
    drop: ["ALL"]
  {{- if $s.enabled }}
  seccompProfile:
    {{- toYaml $s.seccompProfile | nindent 4 }}
  appArmorProfile:
    {{- toYaml $s.appArmorProfile | nindent 4 }}
  {{- if $s.procMountUnmasked }}
  procMount: Unmasked
  {{- end }}
  {{- end }}
{{- end -}}

{{/* "true" when the in-chart NATS runs with one user per service (nats.enabled and nats.auth.enabled). */}}
{{- define "trajmesh.natsAuth" -}}
{{- if and .Values.nats.enabled .Values.nats.auth.enabled -}}
true
{{- end -}}
{{- end -}}

{{/* Roles with a NATS user, in the order of trajmesh.security.NATS_ROLES (environment has none). */}}
{{- define "trajmesh.natsRoles" -}}
{{- list "admin" "store" "rollout" "grader" "learner" "evaluator" | toJson -}}
{{- end -}}

{{/* Secret holding one NATS password per role (keys: the role names); "" when auth is off. */}}
{{- define "trajmesh.natsAuthSecretName" -}}
{{- if (include "trajmesh.natsAuth" .) -}}
{{- if .Values.nats.auth.existingSecret -}}
{{- .Values.nats.auth.existingSecret -}}
{{- else if .Values.nats.auth.create -}}
{{- printf "%s-auth" (include "trajmesh.natsName" .) -}}
{{- else -}}
{{- fail "nats.auth.enabled needs nats.auth.existingSecret (a Secret with keys admin, store, rollout, grader, learner, evaluator) or nats.auth.create=true" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Environment variable through which nats-server reads a role's password ($VAR in nats.conf),
as trajmesh.security names it: TRAJMESH_NATS_PASSWORD_<ROLE>. */}}
{{- define "trajmesh.natsServerPasswordVar" -}}
{{- printf "TRAJMESH_NATS_PASSWORD_%s" (upper .) -}}
{{- end -}}

{{/* JetStream API subjects, mirroring the helpers of trajmesh.security (JSON lists). */}}
{{- define "trajmesh.js.consume" -}}
{{- $api := "$JS.API.CONSUMER" -}}
{{- list (printf "%s.CREATE.%s.%s" $api .stream .durable) (printf "%s.CREATE.%s.%s.>" $api .stream .durable)
         (printf "%s.INFO.%s.%s" $api .stream .durable) (printf "%s.MSG.NEXT.%s.%s" $api .stream .durable)
         (printf "$JS.ACK.%s.%s.>" .stream .durable) (printf "$JS.API.STREAM.INFO.%s" .stream) | toJson -}}
{{- end -}}

{{- define "trajmesh.js.readStream" -}}
{{- list (printf "$JS.API.STREAM.INFO.%s" .) (printf "$JS.API.STREAM.MSG.GET.%s" .)
         (printf "$JS.API.DIRECT.GET.%s" .) (printf "$JS.API.DIRECT.GET.%s.>" .) | toJson -}}
{{- end -}}

{{- define "trajmesh.js.watchStream" -}}
{{- list (printf "$JS.API.CONSUMER.CREATE.%s" .) (printf "$JS.API.CONSUMER.CREATE.%s.>" .)
         (printf "$JS.API.CONSUMER.INFO.%s.>" .) (printf "$JS.API.CONSUMER.DELETE.%s.>" .)
         (printf "$JS.FC.%s.>" .) | toJson -}}
{{- end -}}

{{/*
NATS allow lists of every role for trajmesh.namespace: a template copy of
trajmesh.security.nats_permissions (docs/SECURITY.md). tests/unit/deploy/test_helm_chart.py compares the
rendered nats.conf with the Python function for every role, so the two cannot drift apart.
Returns JSON {role: {"publish": [...], "subscribe": [...]}}.
*/}}
{{- define "trajmesh.natsPermissions" -}}
{{- $ns := .Values.trajmesh.namespace -}}
{{- $pre := ternary (printf "%s_" $ns) "" (ne $ns "") -}}
{{- $subj := ternary (printf "%s." $ns) "" (ne $ns "") -}}
{{- $tasks := printf "%sTASKS" $pre -}}
{{- $raw := printf "%sTRAJ_RAW" $pre -}}
{{- $graded := printf "%sTRAJ_GRADED" $pre -}}
{{- $kvBucket := printf "%strajmesh_weights" $pre -}}
{{- $objBucket := printf "%strajmesh_blobs" $pre -}}
{{- $kvStream := printf "KV_%s" $kvBucket -}}
{{- $objStream := printf "OBJ_%s" $objBucket -}}
{{- $blobs := concat (list (printf "$O.%s.>" $objBucket))
      (include "trajmesh.js.readStream" $objStream | fromJsonArray)
      (include "trajmesh.js.watchStream" $objStream | fromJsonArray)
      (list (printf "$JS.API.STREAM.PURGE.%s" $objStream) "$JS.API.STREAM.NAMES") -}}
{{- $kvRead := include "trajmesh.js.readStream" $kvStream | fromJsonArray -}}
{{- $stores := max 1 (int .Values.store.replicaCount) -}}
{{- $storeConsume := list -}}
{{- $gradedSubjects := list (printf "%strajmesh.traj.graded" $subj) -}}
{{- if eq (int $stores) 1 -}}
{{- $storeConsume = include "trajmesh.js.consume" (dict "stream" $graded "durable" "store") | fromJsonArray -}}
{{- else -}}
{{- $gradedSubjects = list -}}
{{- range $k := until (int $stores) -}}
{{- $storeConsume = concat $storeConsume (include "trajmesh.js.consume" (dict "stream" $graded "durable" (printf "store-%d" $k)) | fromJsonArray) -}}
{{- $gradedSubjects = append $gradedSubjects (printf "%strajmesh.traj.graded.%d" $subj $k) -}}
{{- end -}}
{{- end -}}
{{- $store := concat (list (printf "%strajmesh.tasks" $subj))
      $storeConsume
      $blobs
      (list (printf "$JS.API.CONSUMER.INFO.%s.rollout" $tasks) (printf "$JS.API.CONSUMER.INFO.%s.grader" $raw))
      (include "trajmesh.js.readStream" $tasks | fromJsonArray)
      (include "trajmesh.js.readStream" $raw | fromJsonArray)
      (include "trajmesh.js.readStream" $graded | fromJsonArray) -}}
{{- $rollout := concat (list (printf "%strajmesh.traj.raw" $subj))
      (include "trajmesh.js.consume" (dict "stream" $tasks "durable" "rollout") | fromJsonArray)
      $blobs $kvRead
      (include "trajmesh.js.watchStream" $kvStream | fromJsonArray)
      (list (printf "$KV.%s.anchor_request" $kvBucket)) -}}
{{- $grader := concat $gradedSubjects
      (include "trajmesh.js.consume" (dict "stream" $raw "durable" "grader") | fromJsonArray)
      $blobs (list (printf "_INBOX_%sevaluator.>" $pre)) -}}
{{- $evalStream := printf "%sEVAL" $pre -}}
{{- $learner := concat (list (printf "%strajmesh.weights" $subj) (printf "$KV.%s.latest" $kvBucket))
      $kvRead (list (printf "$JS.API.STREAM.INFO.%sWEIGHTS" $pre))
      (include "trajmesh.js.readStream" $evalStream | fromJsonArray)
      (include "trajmesh.js.watchStream" $evalStream | fromJsonArray) -}}
{{- $evaluator := concat (list (printf "%strajmesh.eval" $subj) (printf "$JS.API.STREAM.INFO.%s" $evalStream))
      $kvRead (include "trajmesh.js.watchStream" $kvStream | fromJsonArray)
      (list (printf "%strajmesh.grade.eval" $subj)) -}}
{{- $pub := dict "admin" (list ">") "store" $store "rollout" $rollout "grader" $grader "learner" $learner
      "evaluator" $evaluator -}}
{{- $out := dict -}}
{{- range $role := include "trajmesh.natsRoles" . | fromJsonArray -}}
{{- $sub := ternary (list ">") (list (printf "_INBOX_%s%s.>" $pre $role)) (eq $role "admin") -}}
{{- if eq $role "grader" }}{{ $sub = append $sub (printf "%strajmesh.grade.eval" $subj) }}{{ end -}}
{{- $_ := set $out $role (dict "publish" (uniq (get $pub $role)) "subscribe" $sub) -}}
{{- end -}}
{{- $out | toJson -}}
{{- end -}}

{{/*
The nats.conf `authorization` block: one user per role with its allow lists. Passwords are not in
it: each is $TRAJMESH_NATS_PASSWORD_<ROLE>, which nats-server resolves from its own environment
(filled from the auth Secret), as the local launcher does (trajmesh.security.nats_authorization).
*/}}
{{- define "trajmesh.natsAuthorization" -}}
{{- $perms := include "trajmesh.natsPermissions" . | fromJson -}}
{{- $roles := include "trajmesh.natsRoles" . | fromJsonArray -}}
authorization {
  users = [
{{- range $i, $role := $roles }}
{{- $p := get $perms $role }}
    {user: {{ $role | quote }}, password: ${{ include "trajmesh.natsServerPasswordVar" $role }}, permissions: {
      publish: {allow: [{{ range $j, $s := $p.publish }}{{ if $j }}, {{ end }}{{ $s | quote }}{{ end }}]},
      subscribe: {allow: [{{ range $j, $s := $p.subscribe }}{{ if $j }}, {{ end }}{{ $s | quote }}{{ end }}]}
    }}{{ if lt (add1 $i) (len $roles) }},{{ end }}
{{- end }}
  ]
}
{{- end -}}

{{/* nats.conf of the in-chart NATS (ConfigMap; holds no secret: passwords are $VARs). */}}
{{- define "trajmesh.natsConf" -}}
{{- $c := .Values.nats -}}
{{- $name := include "trajmesh.natsName" . -}}
{{- $headless := include "trajmesh.natsHeadless" . -}}
server_name: $POD_NAME
port: 4222
http_port: 8222
pid_file: /var/run/nats/nats.pid
max_payload: {{ $c.maxPayload }}
lame_duck_duration: 30s
jetstream {
  store_dir: /data
  max_memory_store: {{ $c.jetstream.maxMemory }}
  max_file_store: {{ $c.jetstream.storage.size }}
}
{{- if gt (int $c.replicaCount) 1 }}
cluster {
  name: {{ $name }}
  port: 6222
  routes: [
    {{- range $i := until (int $c.replicaCount) }}
    nats://{{ $name }}-{{ $i }}.{{ $headless }}:6222
    {{- end }}
  ]
}
{{- end }}
{{- if (include "trajmesh.natsAuth" .) }}
{{ include "trajmesh.natsAuthorization" . }}
{{- end }}
{{- end -}}
